"""`pagedq`: the command line. Each command module exposes registration functions that
add their parser(s) and set `handler=<callable(args) -> int>` as the parser default;
REGISTRATIONS lists them in the order `pagedq --help` shows the commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, function): the commands a user starts with first (up, submit, batch), then the
# service's parts and tools.
REGISTRATIONS = (
    ("pagedq.commands.service", "register_start"),
    ("pagedq.commands.batch", "register"),
    ("pagedq.commands.service", "register"),
    ("pagedq.commands.pull", "register"),
    ("pagedq.commands.make_tiny_model", "register"),
    ("pagedq.commands.bench", "register"),
)

DESCRIPTION = """\
pagedq serves an LLM the way vLLM does (paged KV cache, continuous batching) behind an
asynchronous api: jobs queue in Redis, so nothing is lost when a process restarts.

Start here:
  pagedq up                                    Redis, the api and a worker on this machine
  pagedq submit --chat --wait "Hello"          one prompt, its answer printed
  pagedq batch submit --summarize docs/ --wait -o summaries.jsonl
                                               a summary per document, however long

`pagedq COMMAND --help` describes each command and its flags. Settings also come from
PAGEDQ_* environment variables (a flag wins over its variable)."""


class CommandError(Exception):
    """A user-facing failure: printed without a traceback, exit status 1 (or .exit_code)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedq", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for module, function in REGISTRATIONS:
        getattr(importlib.import_module(module), function)(subparsers)
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
