"""The benchmark workload: random prompt token ids and per-request output lengths, as in
nano-vllm's bench, scaled by command-line flags. Shared by `bench offline` and `bench serve`
so both measure exactly the same requests for a given seed."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from pagedq.model_info import GENERATION_DEFAULT_FIELDS
from pagedq.sampling_params import SamplingParams

# nano-vllm's bench samples at this temperature; --greedy switches to argmax.
DEFAULT_TEMPERATURE = 0.6


@dataclass(frozen=True)
class LengthRange:
    low: int
    high: int

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


def parse_length_range(text: str) -> LengthRange:
    """`LOW:HIGH` (inclusive) or a single `N`; an argparse `type=` so bad values exit 2 with a message."""
    parts = text.split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW:HIGH or N (integers)") from None
    if low < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: lengths must be >= 1")
    if low > high:
        raise argparse.ArgumentTypeError(f"{text!r}: LOW must be <= HIGH")
    return LengthRange(low, high)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def positive_ints(text: str) -> list[int]:
    """`N,N,...`, each >= 1; an argparse `type=`."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    # 0 means greedy.
    temperature: float
    seed: int
    input_len: LengthRange
    output_len: LengthRange

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_total_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))

    def sampling_fields(self) -> dict:
        """The sampling of every request, spelled out whole: a service fills the fields a
        request leaves out from the checkpoint's generation_config.json (SmolLM2's says
        top_p 0.9), which the offline engine, given SamplingParams, does not."""
        return SamplingParams(temperature=self.temperature).model_dump(include=set(GENERATION_DEFAULT_FIELDS))

    def head(self, count: int, max_output_len: int) -> Workload:
        """The first `count` requests with outputs capped: a cheap warm-up with the same shapes' code paths."""
        return Workload(
            prompts=self.prompts[:count],
            output_lens=[min(n, max_output_len) for n in self.output_lens[:count]],
            temperature=self.temperature,
            seed=self.seed,
            input_len=self.input_len,
            output_len=self.output_len,
        )

    def summary(self) -> dict:
        return {
            "num_requests": self.num_requests,
            "input_len": str(self.input_len),
            "output_len": str(self.output_len),
            "temperature": self.temperature,
            "ignore_eos": True,
            "seed": self.seed,
            "total_prompt_tokens": sum(len(p) for p in self.prompts),
            "total_output_tokens": self.total_output_tokens,
        }


def make_workload(
    num_prompts: int,
    input_len: LengthRange,
    output_len: LengthRange,
    vocab_size: int,
    seed: int,
    temperature: float,
) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(rng.randint(input_len.low, input_len.high))]
        for _ in range(num_prompts)
    ]
    output_lens = [rng.randint(output_len.low, output_len.high) for _ in range(num_prompts)]
    return Workload(prompts, output_lens, temperature, seed, input_len, output_len)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=positive_int, default=64, help="requests in the workload (default 64)")
    group.add_argument("--input-len", type=parse_length_range, default=LengthRange(32, 256),
                       metavar="LOW:HIGH", help="prompt lengths, uniform in [LOW, HIGH] (default 32:256)")
    group.add_argument("--output-len", type=parse_length_range, default=LengthRange(32, 256),
                       metavar="LOW:HIGH", help="output lengths, uniform in [LOW, HIGH] (default 32:256)")
    group.add_argument("--seed", type=int, default=0, help="seeds the prompts, lengths and sampling")
    group.add_argument("--greedy", action="store_true",
                       help=f"argmax sampling instead of temperature {DEFAULT_TEMPERATURE}")


def workload_from_args(args: argparse.Namespace, vocab_size: int, context_len: int) -> Workload:
    """Builds the workload, refusing one the model cannot hold (ValueError naming the flag)."""
    longest = args.input_len.high + args.output_len.high
    if longest > context_len:
        raise ValueError(
            f"--input-len/--output-len: up to {longest} tokens per request, "
            f"but the model's context is {context_len} tokens"
        )
    temperature = 0.0 if args.greedy else DEFAULT_TEMPERATURE
    return make_workload(args.num_prompts, args.input_len, args.output_len, vocab_size, args.seed, temperature)

