"""`pagedq bench summarize`: a long document through a summary batch (its own service:
Redis, `pagedq api`, one `pagedq worker`), and the map stage's throughput against pagedq's
offline engine on the same chunks. The service's map stage runs from the submit to the
end of the last chunk's job; its tokens are the chunks' prompt and summary tokens (the
stage's usage). The offline engine then runs the very prompts the jobs held (read back
from Redis), greedy, with the same max_tokens, at the worker's thread count."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from datetime import timezone
from pathlib import Path

from pagedq.bench.offline import add_model_arguments
from pagedq.bench.workload import positive_int
from pagedq.cli import CommandError

_WORDS = ("the committee reviewed quarterly revenue costs hiring risks customers contracts delivery schedule "
          "budget growth market product security audit report findings recommendations").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--doc-tokens", type=positive_int, default=20_000,
                        help="the document's length in the model's tokens, about (default 20000)")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="tokens per summary (default 32)")
    parser.add_argument("--max-model-len", type=positive_int, help="the service's context (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the document's text (default 0)")


def synthetic_document(tokenizer, tokens: int, seed: int) -> str:
    """Paragraphs of sentences, about `tokens` tokens long."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    length = 0
    while length < tokens:
        paragraph = " ".join(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 18))).capitalize() + "."
                             for _ in range(rng.randint(2, 6)))
        paragraphs.append(paragraph)
        length += len(tokenizer.encode(paragraph + "\n\n", add_special_tokens=False))
    return "\n\n".join(paragraphs) + "\n"


def _timestamp(moment) -> float:
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def _service_run(args: argparse.Namespace, text: str, tmp: Path) -> tuple[dict, list[list[int]]]:
    """The batch's numbers, and the map jobs' prompts."""
    from redis import Redis
    from rq.job import Job

    from pagedq.client import Client
    from pagedq.local_service import LocalService, StartupFailed
    from pagedq.redis_schema import JOB_SERIALIZER
    from pagedq.redis_server import free_port
    from pagedq.settings import Settings
    from pagedq.summaries import SUMMARIES_ENDPOINT

    settings = Settings(model=args.model, device=args.device, dtype=args.dtype, port=free_port(), cache_dir=tmp,
                        redis_url=None, api_keys=[], max_model_len=args.max_model_len, batch_poll_interval_s=0.1)
    options = {"max_tokens": args.max_tokens, "temperature": 0}
    log_path = tmp / "service.log"
    with open(log_path, "w") as log:
        service = LocalService(settings, log=log)
        try:
            service.start()
        except StartupFailed as exc:
            raise CommandError(f"{exc}; its log:\n{log_path.read_text()[-4000:]}") from None
        try:
            with Client(service.settings.base_url, timeout_s=600) as client:
                def summarize(doc_id: str, body: str) -> tuple[dict, float]:
                    line = {"custom_id": doc_id, "method": "POST", "url": SUMMARIES_ENDPOINT, "body": {"text": body}}
                    jsonl = (json.dumps(line) + "\n").encode()
                    started = time.time()
                    batch = client.batch_submit(jsonl, SUMMARIES_ENDPOINT, summary=options)
                    return client.batch_wait(batch["id"], poll_s=0.1), started

                summarize("warm-up", text[:2000])  # loads the worker's kernels; not timed
                batch, started = summarize("document", text)
                ended = time.time()
                if batch["request_counts"]["completed"] != 1:
                    raise CommandError(f"the summary batch did not complete: {batch}")
                output, _ = client.batch_results(batch["id"])
            body = json.loads(output.splitlines()[0])["response"]["body"]
            mapped = body["stages"][0]
            redis = Redis.from_url(service.settings.redis_url)
            ids = [f"{batch['id']}-0-0-{part}" for part in range(mapped["requests"])]
            jobs = Job.fetch_many(ids, redis, serializer=JOB_SERIALIZER)
            map_end = max(_timestamp(job.ended_at) for job in jobs)
            prompts = [job.kwargs["prompt_token_ids"] for job in jobs]
        finally:
            service.stop()
    tokens = mapped["prompt_tokens"] + mapped["completion_tokens"]
    return {"stages": body["stages"], "map_seconds": map_end - started, "map_tokens": tokens,
            "map_tok_s": tokens / (map_end - started), "end_to_end_seconds": ended - started}, prompts


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedq import LLM, SamplingParams
    from pagedq.model_info import load_tokenizer
    from pagedq.settings import Settings
    from worker.host_threads import set_torch_threads
    from worker.model_runner import resolve_device
    from worker.rq.engine_factory import torch_threads

    text = synthetic_document(load_tokenizer(args.model), args.doc_tokens, args.seed)
    with tempfile.TemporaryDirectory(prefix="pagedq-bench-summarize-") as tmp:
        service, prompts = _service_run(args, text, Path(tmp))
    device = resolve_device(args.device)
    threads = torch_threads(Settings(model=args.model, device=args.device), device)
    if threads is not None:
        set_torch_threads(threads)  # the worker's count, so the ratio isolates the service's path
    llm = LLM(model=args.model, dtype=args.dtype, device=str(device), max_model_len=args.max_model_len)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up, not timed
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    offline_tokens = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outputs)
    offline_tok_s = offline_tokens / seconds

    stages = ", ".join(f"{s['kind']} {s['stage']}: {s['requests']}" for s in service["stages"])
    print(f"model {args.model}; a {args.doc_tokens}-token document, max_tokens {args.max_tokens}; stages: {stages}")
    print(f"{'run':<34}{'map prompts':>12}{'tokens':>10}{'seconds':>10}{'tok/s':>10}")
    print(f"{'pagedq service (summary batch)':<34}{len(prompts):>12}{service['map_tokens']:>10}"
          f"{service['map_seconds']:>10.2f}{service['map_tok_s']:>10.1f}")
    print(f"{'pagedq offline (LLM.generate)':<34}{len(prompts):>12}{offline_tokens:>10}{seconds:>10.2f}"
          f"{offline_tok_s:>10.1f}")
    print(f"map stage, service / offline: {service['map_tok_s'] / offline_tok_s:.2f}x "
          f"(torch threads {torch.get_num_threads()}); whole document end to end: "
          f"{service['end_to_end_seconds']:.2f}s")
    return 0
