"""The ``trainmon`` command line. Each subcommand lives in its own module exposing ``register``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from trainmon import __version__

# Modules under trainmon.cli, each with ``register(subparsers)`` adding one subcommand.
_SUBCOMMANDS = ("demo", "config_cmd", "analyze", "dump", "compare", "csv2tb", "export", "migrate")
# The module of each command, so that a command imports only its own module (``analyze`` answers in well
# under a second; importing every command's dependencies, pandas among them, took most of that).
_COMMANDS = {"demo": "demo", "config": "config_cmd", "analyze": "analyze", "dump": "dump",
             "compare": "compare", "csv2tb": "csv2tb", "tb2csv": "csv2tb", "export": "export",
             "migrate": "migrate"}  # fmt: skip


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of the one ``argv`` names (its help and errors are the same)."""
    parser = argparse.ArgumentParser(
        prog="trainmon", description="Training monitor for large-model training."
    )
    parser.add_argument("--version", action="version", version=f"trainmon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = next((a for a in argv or () if not a.startswith("-")), None)
    modules = (_COMMANDS[command],) if command in _COMMANDS else _SUBCOMMANDS
    for module_name in modules:
        importlib.import_module(f"trainmon.cli.{module_name}").register(sub)
    return parser


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the flush at exit does not report the closed pipe again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured): nothing is flushed at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            args = build_parser(sys.argv[1:] if argv is None else argv).parse_args(argv)
            return int(args.func(args) or 0)
        finally:
            # Output to a pipe is buffered: flushed here, a reader that has gone (`trainmon dump ls RUN |
            # head -1`) shows up inside this handler rather than as a traceback at exit.
            sys.stdout.flush()
    except BrokenPipeError:  # the reader has all it wanted: not an error
        _silence_stdout()
        return 0


if __name__ == "__main__":
    sys.exit(main())
