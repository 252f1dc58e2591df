"""Command line: ``python -m ddp_notebook demo`` and ``python -m ddp_notebook gpus``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_notebook", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small network on 8x8 digits with DDP, with live progress")
    demo.add_argument("--cpus", type=int, default=None, help="CPU ranks (default: the GPUs, or 2 CPU ranks)")
    demo.add_argument("--gpus", default=None, help="GPU count or indices")
    demo.add_argument("--epochs", type=int, default=12)
    commands.add_parser("gpus", help="list the GPUs, their load and our jobs on them")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(cpus=args.cpus, gpus=args.gpus, epochs=args.epochs)
    if args.command == "gpus":
        from . import gpus

        print(gpus.table(*gpus.discover_report()))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
