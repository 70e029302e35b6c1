"""The ``hpx`` command: look at a saved run.

``hpx report HISTORY [--plot OUT.png]`` prints the knob trajectories of a history
saved with :func:`hpx.save_history` (or an engine's ``history_file``) and optionally
plots them. It does not import torch. ``hpx --version`` prints the version.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hpx import __version__
from hpx.history import format_history, load_history

__all__ = ["main"]

# argparse prints these as they are: plain text, not the module docstring's reStructuredText
_DESCRIPTION = ("Look at a saved run: hpx report HISTORY [--plot OUT.png] prints (and plots) the knob "
                "trajectories of a history written by hpx.save_history or an engine's history_file.")
_REPORT = ("Print the knob trajectories of a history saved with hpx.save_history (or an engine's "
           "history_file), and optionally plot them. Does not import torch.")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpx", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"hpx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="print (and plot) the knob trajectories of a saved history",
                         description=_REPORT)
    rep.add_argument("history", help="a history written by hpx.save_history, or a history_file")
    rep.add_argument("--plot", metavar="PNG", help="also write a plot to this file")
    rep.add_argument("--every", type=int, default=1, help="print every N-th sync (default 1)")
    args = parser.parse_args(argv)
    try:
        history = load_history(args.history)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"hpx: cannot read {args.history}: {exc}", file=sys.stderr)
        return 2
    print(format_history(history, every=max(1, args.every)))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("hpx: --plot needs matplotlib: pip install matplotlib (or the hpx-hdet[plot] extra)",
                  file=sys.stderr)
            return 2
        from hpx.history import plot_history

        try:
            print(f"plot written to {plot_history(history, args.plot)}")
        except ValueError as exc:  # an empty history: nothing to plot
            print(f"hpx: no plot: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
