"""The C++ kernels of the CPU engine (csrc/): paged attention and the KV store
(kernels.cpu_attention), and the per-layer elementwise ops (kernels.cpu_elementwise), built
as one extension with torch's cpp_extension at first use and cached (under
TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions): a first build takes about a
minute, later processes load it in a fraction of a second. It is compiled for the CPU it
runs on (-march=native), so the build name carries a digest of the CPU's flags. Where it
cannot be built (no C++ compiler), `load()` says why and the engine falls back to pure
PyTorch. PAGEDQ_CPU_KERNEL=0 skips it.
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

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_attention.cpp", CSRC / "cpu_elementwise.cpp")
HEADERS = (CSRC / "vec.h",)
# No -ffast-math: the kernels' fp32 results stay within rounding of the reference's.
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


def build_name(sources: tuple[Path, ...] = SOURCES, headers: tuple[Path, ...] = HEADERS) -> str:
    """One build per source text, flags, CPU and source path, so no build overwrites
    another's cache entry. The path counts because torch writes it into the build's
    build.ninja: two checkouts of the same source sharing one entry rebuilt it (a minute
    of compiling, under a lock every other process's start waits on) each time a process
    of the other checkout started."""
    identity = b"".join(path.read_bytes() + str(path.resolve()).encode() for path in (*sources, *headers))
    digest = hashlib.sha256(identity + " ".join(CFLAGS).encode()).hexdigest()[:8]
    return f"pagedq_cpu_kernels_{digest}_{_cpu_digest()}"


@functools.cache
def load() -> bool:
    """Builds (or loads the cached build of) the extension; False, with a warning naming
    the cause, where it cannot be had."""
    if os.environ.get("PAGEDQ_CPU_KERNEL", "1") == "0":
        return False
    if shutil.which("ninja") is None:
        # The `ninja` package installs its binary beside this interpreter, which is not on
        # PATH when the virtualenv is used without being activated.
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    try:
        from torch.utils.cpp_extension import load as load_extension

        load_extension(name=build_name(SOURCES, HEADERS), sources=[str(path) for path in SOURCES], extra_cflags=CFLAGS,
                       is_python_module=False)
    except Exception as exc:  # a missing compiler, a failed build: the pure-PyTorch paths still run
        logger.warning("the C++ CPU kernels are unavailable (%s); using the PyTorch paths", exc)
        return False
    return True
