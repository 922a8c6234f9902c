"""`pagedq bench prefix-cache`: requests sharing a long prefix (a system prompt, a document
asked several questions) through pagedq with automatic prefix caching off, then on, in one
process on the same model. Prints the time to finish them, the prompt tokens actually
prefilled (engine counters) and the ratio, and checks both runs produced the same tokens."""

from __future__ import annotations

import argparse
import random
import time

from pagedq.bench.offline import add_model_arguments, first_mismatch
from pagedq.bench.workload import LengthRange, parse_length_range, positive_int
from pagedq.cli import CommandError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--num-prompts", type=positive_int, default=32, help="requests sharing the prefix (default 32)")
    parser.add_argument("--prefix-len", type=positive_int, default=512, help="shared prefix tokens (default 512)")
    parser.add_argument("--suffix-len", type=parse_length_range, default=LengthRange(16, 64), metavar="LOW:HIGH",
                        help="each request's own tokens after the prefix (default 16:64)")
    parser.add_argument("--output-len", type=positive_int, default=32, help="tokens generated per request (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts (default 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers and their context here")


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(vocab_size) for _ in range(args.prefix_len)]
    return [
        prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(args.suffix_len.low, args.suffix_len.high))]
        for _ in range(args.num_prompts)
    ]


def measure(args: argparse.Namespace, prompts: list[list[int]], caching: bool) -> dict:
    from pagedq import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, seed=args.seed, enable_prefix_caching=caching)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm up on tokens that share nothing with the workload, so no prefix is cached yet.
    llm.generate([{"prompt_token_ids": [1] * 8}], SamplingParams(max_tokens=2), use_tqdm=False)
    before = engine.stats()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=True)
    seconds = time.perf_counter() - start
    after = engine.stats()
    return {
        "prefix_caching": caching,
        "seconds": seconds,
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
        "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outputs) / seconds,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def run(args: argparse.Namespace) -> int:
    from pagedq.bench.report import device_description, format_table, versions, write_json
    from pagedq.model_info import load_hf_config
    from worker.model_runner import resolve_device

    try:
        hf_config = load_hf_config(args.model)
        device = resolve_device(args.device)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    prompts = make_prompts(args, hf_config.vocab_size)
    print(f"{args.num_prompts} requests: a shared {args.prefix_len}-token prefix, then {args.suffix_len} own tokens; "
          f"{args.output_len} greedy output tokens each; model {args.model} on {device}", flush=True)
    runs = [measure(args, prompts, caching) for caching in (False, True)]
    off, on = runs
    header = ["prefix caching", "seconds", "prompt tokens", "prefilled", "cache hits", "output tok/s"]
    rows = [
        ["on" if r["prefix_caching"] else "off", f"{r['seconds']:.2f}", str(r["prompt_tokens"]),
         str(r["prompt_tokens_computed"]), str(r["prefix_cache_hits"]), f"{r['output_tokens_per_s']:.1f}"]
        for r in runs
    ]
    print()
    print(format_table(header, rows))
    speedup = off["seconds"] / on["seconds"]
    print(f"\ntime to finish, off / on: {speedup:.2f}x; prompt tokens prefilled, off / on: "
          f"{off['prompt_tokens_computed'] / max(on['prompt_tokens_computed'], 1):.2f}x")
    mismatch = first_mismatch(off["token_ids"], on["token_ids"])
    print("outputs: identical with and without prefix caching" if mismatch is None else f"FAILED: outputs differ: {mismatch}")
    if args.json:
        summary = [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]
        write_json(args.json, args, {"device": device_description(device), "versions": versions(),
                                     "results": summary, "speedup": speedup, "identical": mismatch is None})
    return 0 if mismatch is None else 1
