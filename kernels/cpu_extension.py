"""The C++ kernels of the CPU engine (csrc/): paged attention and the KV store
(kernels.cpu_attention), and the per-layer elementwise ops (kernels.cpu_elementwise), built
as one extension with torch's cpp_extension at first use and cached (under
TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions): a first build takes about a
minute, later processes load it in a fraction of a second, one process at a time (a lock
that dies with its holder: `_building`). It is compiled for the CPU it
runs on (-march=native), so the build name carries a digest of the CPU's flags. Where it
cannot be built (no C++ compiler), `load()` says why and the engine falls back to pure
PyTorch. PAGEDQ_CPU_KERNEL=0 skips it.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as load_extension

        name = build_name(SOURCES, HEADERS)
        # torch's own directory for the build (its default, or under TORCH_EXTENSIONS_DIR).
        build_directory = Path(_get_build_directory(name, verbose=False))
        with _building(build_directory):
            load_extension(name=name, sources=[str(path) for path in SOURCES], extra_cflags=CFLAGS,
                           is_python_module=False, build_directory=str(build_directory))
    except Exception as exc:  # a missing compiler, a failed build: the pure-PyTorch paths still run
        logger.warning("the C++ CPU kernels are unavailable (%s); using the PyTorch paths", exc)
        return False
    return True


@contextmanager
def _building(build_directory: Path) -> Iterator[None]:
    """Holds the build directory for one process's build or load. torch's own lock (a file
    `lock` it creates and deletes) outlives a process killed while it builds, and every later
    load then waits for it forever: each worker start on the machine hung. This lock is the
    kernel's (flock), let go when its holder dies however it dies; a torch `lock` found while
    holding it is one such dead process's, and is removed."""
    with open(build_directory / "pagedq.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_directory / "lock").unlink(missing_ok=True)
        yield
