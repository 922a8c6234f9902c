"""Medians of the alternated base/head `pagedq bench serve` runs in ab/ and ab-more/ (run from this folder)."""
import glob
import json
import statistics

for mode in ("--no-stream", "--stream"):
    print(f"## {mode}")
    for tree in ("base", "head"):
        runs = [json.load(open(f)) for f in sorted(glob.glob(f"ab*/{tree}{mode}-*.json"))]
        def column(get):
            return [get(r) for r in runs]
        service = column(lambda r: sum(r["serve"]["cpu_s"][p] for p in ("worker", "api", "engine core", "redis")))
        ratio = [s / r["offline"]["cpu_seconds"] for s, r in zip(service, runs)]
        cols = {
            "runs": [len(runs)],
            "steps": column(lambda r: r["serve"]["engine_steps"]),
            "engine core CPU s": column(lambda r: r["serve"]["cpu_s"]["engine core"]),
            "worker CPU s": column(lambda r: r["serve"]["cpu_s"]["worker"]),
            "api CPU s": column(lambda r: r["serve"]["cpu_s"]["api"]),
            "service CPU s": service,
            "offline CPU s": column(lambda r: r["offline"]["cpu_seconds"]),
            "service / offline CPU": ratio,
            "serve tok/s": column(lambda r: r["serve"]["output_tokens_per_s"]),
            "serve / offline tok/s": column(lambda r: r["serve_over_offline"]),
            "202 p50 ms": column(lambda r: r["serve"]["accept_ms"]["p50"]),
            "TTFT p50 ms": column(lambda r: (r["serve"]["ttft_ms"] or {}).get("p50", float("nan"))),
        }
        print(tree, "  ".join(f"{k}: {statistics.median(v):.2f} [{', '.join(f'{x:.2f}' for x in v)}]" if k != "runs" else f"runs {v[0]}"
                              for k, v in cols.items()))
