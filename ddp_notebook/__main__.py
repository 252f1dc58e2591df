"""Command line: ``python -m ddp_notebook demo`` and ``python -m ddp_notebook gpus``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    # Help is plain text: the module docstring's markup would show as is.
    parser = argparse.ArgumentParser(prog="python -m ddp_notebook",
                                     description="Run the DDP demo job, or list the GPUs this machine has.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small network on 8x8 digits with DDP, with live progress",
                               description="Train a small network on scikit-learn's 8x8 digits with DDP, with "
                                           "live progress.")
    demo.add_argument("--cpus", type=int, default=None, help="CPU ranks (default: the GPUs, or 2 CPU ranks)")
    demo.add_argument("--gpus", default=None, help="GPU count or indices")
    demo.add_argument("--epochs", type=int, default=12)
    commands.add_parser("gpus", help="list the GPUs, their load and our jobs on them")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main
        from .wire.errors import LaunchError, Stopped

        try:
            return demo_main(cpus=args.cpus, gpus=args.gpus, epochs=args.epochs)
        except LaunchError as exc:  # refused before any rank started: the message, not a traceback
            demo.exit(2, f"{demo.prog}: error: {exc}\n")
        except Stopped as stop:  # Ctrl-C: every rank stopped at the same batch; one line, as for a cell
            demo.exit(130, f"{demo.prog}: {stop.where}\n")
    if args.command == "gpus":
        from .engine import devices as gpus

        print(gpus.table(*gpus.discover_report()))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
