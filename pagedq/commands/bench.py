"""`pagedq bench {offline,serve,host,kernels,cpu-kernels,prefix-cache,submit,chaos,summarize,structured}`: each subcommand's module brings its own arguments
(`add_arguments(parser)`) and entry point (`run(args) -> int`)."""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = {
    "offline": ("pagedq.bench.offline", "offline throughput: pagedq vs transformers peers on one workload"),
    "serve": ("pagedq.bench.serve", "online latency and throughput through the HTTP service"),
    "host": ("pagedq.bench.host", "the engine's host cost per step, the forward taken out"),
    "kernels": ("pagedq.bench.kernels", "paged attention kernel timings"),
    "cpu-kernels": ("pagedq.bench.cpu_kernels", "the CPU engine's C++ kernels, each beside what it replaces"),
    "prefix-cache": ("pagedq.bench.prefix_cache", "requests sharing a long prefix, prefix caching off vs on"),
    "submit": ("pagedq.bench.submit", "how fast the api accepts jobs: N concurrent POST /generate"),
    "chaos": ("pagedq.bench.chaos", "a soak under faults: no job lost, duplicated or stuck"),
    "summarize": ("pagedq.bench.summarize", "a long document's summary batch: the map stage vs the offline engine"),
    "structured": ("pagedq.bench.structured", "what structured outputs cost: a batch half under a JSON schema vs all free"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks",
        description="Benchmarks: pagedq beside its peers (vLLM, transformers) on one workload, the service "
                    "end to end, the kernels alone. Each runs its peers in the same run and prints ratios.")
    bench_subparsers = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        # Imported only when the CLI is built; the modules keep torch and model imports inside run().
        module = importlib.import_module(module_name)
        parser = bench_subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(parser)
        parser.set_defaults(handler=module.run)
