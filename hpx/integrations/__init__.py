"""Integrations with training frameworks. Each module imports its framework only when used:
``hpx.integrations.lightning`` (PyTorch Lightning)."""
