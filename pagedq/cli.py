"""`pagedq` command line: each subcommand lives in its own module under pagedq.commands.

A command module exposes `register(subparsers)`, which adds its parser(s) and sets
`handler=<callable(args) -> int>` as the parser default.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "pagedq.commands.make_tiny_model",
    "pagedq.commands.bench",
    "pagedq.commands.service",
    "pagedq.commands.batch",
    "pagedq.commands.pull",
)


class CommandError(Exception):
    """A user-facing failure: printed without a traceback, exit status 1 (or .exit_code)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedq", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except CommandError as exc:
        print(f"pagedq: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # `python -m pagedq.cli` (how `pagedq up` starts its children) runs this file as
    # __main__, a second copy of the module: call the package's main, whose CommandError is
    # the class the commands raise, so their errors stay one line instead of a traceback.
    from pagedq.cli import main as package_main

    sys.exit(package_main())
