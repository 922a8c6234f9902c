"""`pagedq bench structured`: what structured outputs cost. One engine runs the same batch
three ways per round, alternated: half of the requests (every other one) under a JSON
schema; the same batch free, each of that half capped at the length its JSON took
(`ignore_eos`: the same tokens to make, so what differs is the grammar's own cost: compile
cache lookups, matchers, masks); and every request free to its max_tokens. Prints output
tokens per second of each and the ratios per round, and checks every constrained output
validates against the schema.

Constrained requests end when their JSON does, so the all-free batch keeps more rows
running for longer: its ratio also counts the batch thinning out, which is the workload's
shape, not the grammar's cost."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from pagedq.bench.offline import add_model_arguments
from pagedq.bench.workload import positive_int
from pagedq.cli import CommandError

# A record a model can fill: bounded everywhere, so a constrained output ends.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
}
SUBJECTS = ["a sailor", "a baker from Lyon", "a retired teacher", "a chess champion", "a young pilot", "a gardener",
            "a violinist", "a mountain guide", "a software engineer", "a painter"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--num-prompts", type=positive_int, default=64, help="requests per batch (default 64)")
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="output tokens per request at most (default 128)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="alternated rounds (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and sampling (default 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers and their context here")


def prompts(tokenizer, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = [f"Describe {rng.choice(SUBJECTS)} as a JSON record with name, age, city, hobbies and employed."
             for _ in range(count)]
    if getattr(tokenizer, "chat_template", None):
        return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                for t in texts]
    return texts


def run_batch(llm, texts: list[str], params: list) -> tuple[float, int, list]:
    start = time.perf_counter()
    outputs = llm.generate(texts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs), outputs


def run(args: argparse.Namespace) -> int:
    from pagedq import LLM, SamplingParams
    from pagedq.bench.report import format_table, write_json

    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, seed=args.seed, max_num_seqs=max(args.num_prompts, 8))
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    texts = prompts(llm.get_tokenizer(), args.num_prompts, args.seed)
    free = SamplingParams(temperature=0.8, seed=args.seed, max_tokens=args.max_tokens)
    constrained = SamplingParams(temperature=0.8, seed=args.seed, max_tokens=args.max_tokens,
                                 structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    mixed = [constrained if i % 2 else free for i in range(len(texts))]
    # Warm up both paths (the grammar compiles once; later rounds find it cached).
    run_batch(llm, texts[:4], mixed[:4])
    print(f"{args.num_prompts} requests, half under a JSON schema; model {args.model}; "
          f"{os.cpu_count()} CPUs", flush=True)
    rows, ratios, thinning, invalid = [], [], [], 0
    for round_index in range(args.rounds):
        load = os.getloadavg()[0]
        mixed_s, mixed_tokens, outputs = run_batch(llm, texts, mixed)
        matched = [
            free if i % 2 == 0 else SamplingParams(temperature=0.8, seed=args.seed, ignore_eos=True,
                                                   max_tokens=len(output.outputs[0].token_ids))
            for i, output in enumerate(outputs)
        ]
        matched_s, matched_tokens, _ = run_batch(llm, texts, matched)
        free_s, free_tokens, _ = run_batch(llm, texts, [free] * len(texts))
        for output in outputs[1::2]:
            completion = output.outputs[0]
            try:
                record = json.loads(completion.text, strict=False)
                valid = completion.finish_reason == "stop" and set(record) == set(SCHEMA["required"])
            except ValueError:
                valid = False
            invalid += not valid
        mixed_rate, matched_rate, free_rate = mixed_tokens / mixed_s, matched_tokens / matched_s, free_tokens / free_s
        ratios.append(mixed_rate / matched_rate)
        thinning.append(mixed_rate / free_rate)
        rows.append([str(round_index + 1), f"{load:.2f}", f"{mixed_rate:.1f}", f"{matched_rate:.1f}", f"{free_rate:.1f}",
                     f"{ratios[-1]:.3f}", f"{thinning[-1]:.3f}"])
    print()
    print(format_table(["round", "load 1m", "half JSON tok/s", "same lengths free", "all free tok/s",
                        "JSON / same lengths", "JSON / all free"], rows))
    median = statistics.median(ratios)
    print(f"\nhalf under a JSON schema / the same tokens free: median {median:.3f}x ({(1 - median) * 100:+.1f}% cost); "
          f"/ all free: median {statistics.median(thinning):.3f}x; "
          f"constrained outputs not valid: {invalid} of {args.rounds * (len(texts) // 2)}")
    if args.json:
        write_json(args.json, args, {"ratios": ratios, "median": median, "all_free_ratios": thinning, "invalid": invalid})
    return 0 if invalid == 0 else 1
