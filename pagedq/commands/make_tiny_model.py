"""`pagedq make-tiny-model DIR`: write a random-weight checkpoint and tokenizer for tests
and benchmarks (no downloads)."""

from __future__ import annotations

import argparse
import dataclasses

from pagedq.cli import CommandError
from pagedq.tiny_model import DTYPES, PRESETS, TINY_ARCHS, make_tiny_model, tiny_shape

# Flags that resize the model, named after pagedq.tiny_model.Shape's fields.
SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(tiny_shape("llama")))


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "make-tiny-model",
        help="write a random-weight Hugging Face checkpoint with a locally trained tokenizer",
        description=__doc__,
    )
    parser.add_argument("dir", help="output directory")
    parser.add_argument("--arch", choices=TINY_ARCHS, help="architecture (default: llama, or the preset's)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named model shape")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights (default 0)")
    parser.add_argument("--dtype", choices=DTYPES, help="saved weight dtype (default: float32, or the preset's)")
    parser.add_argument("--max-shard-size", help="write a sharded checkpoint, e.g. 200MB")
    shape = parser.add_argument_group("shape (overrides the tiny default or the preset)")
    for name in SHAPE_FIELDS:
        shape.add_argument(f"--{name.replace('_', '-')}", type=int, metavar="N", help=f"the config's {name}")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    arch = args.arch or (PRESETS[args.preset].arch if args.preset else "llama")
    base = PRESETS[args.preset].shape if args.preset else tiny_shape(arch)
    resized = {name: getattr(args, name) for name in SHAPE_FIELDS if getattr(args, name) is not None}
    try:
        overrides = dataclasses.replace(base, **resized).config_kwargs(arch) if resized else {}
        path = make_tiny_model(
            args.dir, args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype,
            max_shard_size=args.max_shard_size, **overrides,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    print(f"wrote {arch} checkpoint to {path}")
    return 0
