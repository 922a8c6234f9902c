"""`pagedq bench host`: the engine's own cost per step on the host, the forward taken out.

On a GPU the host prepares each step while the device runs the last one; when the host
needs longer than the device, the host sets the pace. This measures the host's side
alone: a stub forward (fixed logits, no compute: `EngineArgs.stub_forward`) under the
real scheduler, input preparation, sampler and output processing, with N requests
running at once (N prompts of --prompt-len tokens, --output-len new tokens each,
greedy, ignore_eos). It prints the mean host time of a decode-only step (every running
sequence one token), per step and per sequence-step, split by phase
(pagedq.core.step_timings), and the whole run's output tokens per second.

    pagedq make-tiny-model /tmp/host --preset host-bench
    pagedq bench host --model /tmp/host --running 64,256,1024
"""

from __future__ import annotations

import argparse

from pagedq.bench.workload import positive_int, positive_ints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="local checkpoint (`pagedq make-tiny-model DIR --preset host-bench`)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the engine runs (default cpu)")
    parser.add_argument("--running", type=positive_ints, default=[64, 256, 1024], metavar="N,N,...",
                        help="requests running at once, one measurement each (default 64,256,1024)")
    parser.add_argument("--prompt-len", type=positive_int, default=32, help="prompt tokens per request (default 32)")
    parser.add_argument("--output-len", type=positive_int, default=256, help="tokens generated per request (default 256)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timed passes per count (default 3)")
    parser.add_argument("--real-forward", action="store_true", help="run the model's forward too (a breakdown of real steps)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers and their context here")


def measure(args: argparse.Namespace, running: int) -> dict:
    import random
    import time

    from pagedq import LLM, SamplingParams
    from pagedq.core.step_timings import StepTimings

    llm = LLM(
        model=args.model, device=args.device, dtype="float32" if args.device == "cpu" else "auto",
        stub_forward=not args.real_forward, max_num_seqs=running, max_num_batched_tokens=max(2048, running),
        max_model_len=args.prompt_len + args.output_len, seed=0,
    )
    vocab = llm.llm_engine.vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_len)]} for _ in range(running)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    timings = StepTimings()
    llm.llm_engine.set_step_timings(timings)
    rounds = []
    for _ in range(args.rounds):
        timings.clear()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rounds.append({"seconds": seconds, "output_tokens_per_s": tokens / seconds, **timings.summary()})
    ordered = sorted(rounds, key=lambda r: r["us_per_step"])
    return {"running": running, "rounds": rounds, "fastest": ordered[0], "median": ordered[len(ordered) // 2]}


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedq.bench.report import format_table, load_average, versions, write_json
    from pagedq.core.step_timings import PHASES

    torch.set_num_threads(args.threads)
    forward = "real forward" if args.real_forward else "stub forward"
    print(f"{forward}, {args.device}, {args.threads} threads; prompts of {args.prompt_len} tokens, "
          f"{args.output_len} new tokens each, greedy; {args.rounds} rounds; load average {load_average()}", flush=True)
    results = []
    for running in args.running:
        results.append(measure(args, running))
        print(f"  {running} running: {results[-1]['fastest']['us_per_step']:.0f} us per decode step "
              f"(load average {load_average()})", flush=True)
    header = ["running", "decode steps", "us/step", "median", "us/seq-step", *[f"{p} us" for p in PHASES], "out tok/s"]
    rows = []
    for result in results:
        m = result["fastest"]
        rows.append([
            str(result["running"]), str(m["steps"]), f"{m['us_per_step']:.0f}", f"{result['median']['us_per_step']:.0f}",
            f"{m['us_per_seq_step']:.2f}", *[f"{m['phases_us_per_step'][p]:.0f}" for p in PHASES],
            f"{m['output_tokens_per_s']:.0f}",
        ])
    print()
    print(format_table(header, rows))
    print(f"\n  host time per decode-only step: the fastest of {args.rounds} rounds (its phases; a shared machine only "
          f"ever adds time), and the median round's; load average after: {load_average()}")
    if args.json:
        write_json(args.json, args, {"forward": forward, "device": args.device, "threads": args.threads,
                                     "versions": versions(), "results": results, "load_average_after": load_average()})
    return 0
