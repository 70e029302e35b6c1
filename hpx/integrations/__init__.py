"""Integrations with training frameworks. Each module imports its framework only when used:
``hpx.integrations.lightning`` (PyTorch Lightning) and ``hpx.integrations.transformers``
(the Hugging Face ``Trainer``)."""
