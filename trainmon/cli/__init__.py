"""The ``trainmon`` command line. Each subcommand lives in its own module exposing ``register``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules under trainmon.cli, each with ``register(subparsers)`` adding one subcommand.
_SUBCOMMANDS = ("demo", "config_cmd", "analyze", "dump", "compare", "csv2tb")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainmon", description="Training monitor for large-model training."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _SUBCOMMANDS:
        importlib.import_module(f"trainmon.cli.{module_name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
