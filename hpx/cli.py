"""The ``hpx`` command: look at a saved run.

``hpx report HISTORY.json [--plot OUT.png]`` prints the knob trajectories of a
history saved with :func:`hpx.save_history` and optionally plots them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hpx.history import format_history, load_history, plot_history

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="print (and plot) the knob trajectories of a saved history")
    rep.add_argument("history", help="JSON written by hpx.save_history")
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
        print(f"plot written to {plot_history(history, args.plot)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
