"""Paged attention and KV store for the CPU engine: a C++ kernel (csrc/cpu_attention.cpp)
that reads keys and values where they sit in the paged cache, every sequence of a step
(decodes, prefills, chunks after a cached prefix) in one call. Same signatures as
`kernels.reference`, against which it is tested.

The kernel is built with torch's cpp_extension at first use and cached (under
TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions): a first build takes about a
minute, later processes load it in a fraction of a second. It is compiled for the CPU it
runs on (-march=native), so the build name carries a digest of the CPU's flags. Where it
cannot be built (no C++ compiler), `load()` says why and the engine falls back to the
pure-PyTorch path, kernels.torch_attention. PAGEDQ_CPU_KERNEL=0 skips it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
# No -ffast-math: the kernel's fp32 results stay within rounding of the reference's.
# -fopenmp: at::parallel_for is a header template whose `#pragma omp parallel` is compiled
# into this extension; without the flag the pragma is dropped and every call runs on one
# thread (seen: attention took as long with 2 threads as with 1). No -lgomp: the GOMP_*
# symbols resolve to the libgomp torch ships and has loaded, so both share one thread
# pool (linking libgomp here also broke loading the kernel a second time in a process).
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]


def _cpu_digest() -> str:
    """Identifies the instruction sets the build may use (a -march=native binary must not
    be loaded on a CPU that lacks them)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def build_name(source: Path) -> str:
    """One build per source text, flags, CPU and source path, so no build overwrites
    another's cache entry. The path counts because torch writes it into the build's
    build.ninja: two checkouts of the same source sharing one entry rebuilt it (a minute
    of compiling, under a lock every other process's start waits on) each time a process
    of the other checkout started."""
    identity = source.read_bytes() + " ".join(CFLAGS).encode() + str(source.resolve()).encode()
    digest = hashlib.sha256(identity).hexdigest()[:8]
    return f"pagedq_cpu_attention_{digest}_{_cpu_digest()}"


@functools.cache
def load() -> bool:
    """Builds (or loads the cached build of) the kernel; False, with a warning naming the
    cause, where it cannot be had."""
    if os.environ.get("PAGEDQ_CPU_KERNEL", "1") == "0":
        return False
    if shutil.which("ninja") is None:
        # The `ninja` package installs its binary beside this interpreter, which is not on
        # PATH when the virtualenv is used without being activated.
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    try:
        from torch.utils.cpp_extension import load as load_extension

        load_extension(name=build_name(SOURCE), sources=[str(SOURCE)], extra_cflags=CFLAGS, is_python_module=False)
    except Exception as exc:  # a missing compiler, a failed build: the pure-PyTorch path still runs
        logger.warning("the C++ CPU attention kernel is unavailable (%s); using the PyTorch SDPA path", exc)
        return False
    return True


def store_kv_cpu(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    torch.ops.pagedq_cpu.store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if out is None:
        out = torch.empty_like(query)
    torch.ops.pagedq_cpu.paged_attention(
        query.contiguous(), key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale,
        sliding_window or 0, out,
    )
    return out
