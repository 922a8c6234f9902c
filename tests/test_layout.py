"""The process boundaries hold in the imports: the engine core and the device side never
reach into the front (pagedq.front: LLM, LLMEngine, input and output processing,
detokenizer, core client) nor into the service processes; the api and the worker never
import each other. Checked on the source, so a stray import fails here and not on a
deployment where the other side's packages are missing."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Package (as a path prefix) -> module prefixes it must not import.
FORBIDDEN = {
    "pagedq/core": ("pagedq.front", "api", "worker.rq"),
    "worker": ("pagedq.front", "pagedq.core", "api"),
    "scheduler": ("pagedq.front", "worker", "api"),
    "blockmgr": ("pagedq", "worker", "scheduler", "api"),
    "kernels": ("pagedq", "worker", "scheduler", "blockmgr", "api"),
    "api": ("worker", "pagedq.front", "pagedq.core"),
}
# The RQ worker process is a front of its own: it drives the engine through LLMEngine.
ALLOWED = {"worker/rq": ("pagedq.front", "pagedq.core")}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def violations(package: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / package).rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        allowed = next((prefixes for folder, prefixes in ALLOWED.items() if relative.startswith(folder + "/")), ())
        for module in imported_modules(path):
            for prefix in forbidden:
                if (module == prefix or module.startswith(prefix + ".")) and not any(
                    module == a or module.startswith(a + ".") for a in allowed
                ):
                    found.append(f"{relative} imports {module}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_keeps_to_its_side_of_the_boundary(package):
    assert violations(package, FORBIDDEN[package]) == []


def test_the_check_sees_a_forbidden_import(tmp_path):
    """The checker itself can fail: a core module importing the front is found."""
    (tmp_path / "pagedq" / "core").mkdir(parents=True)
    (tmp_path / "pagedq" / "core" / "bad.py").write_text("from pagedq.front.llm_engine import LLMEngine\n")
    assert violations("pagedq/core", FORBIDDEN["pagedq/core"], tmp_path) == [
        "pagedq/core/bad.py imports pagedq.front.llm_engine"
    ]


@pytest.mark.parametrize("package", ["api", "blockmgr", "kernels", "pagedq", "scheduler", "worker"])
def test_an_installed_process_imports_this_projects_top_level_packages(package, tmp_path):
    """What `pagedq api`, `pagedq worker` and the engine core import is this tree, not an
    installed distribution of the same top-level name: Hugging Face's `kernels` (which
    transformers 5.25 requires) shadowed `kernels/` in every process started outside the
    repository, so the engine could not load. Run from elsewhere, where the repository is
    not on sys.path by way of the working directory."""
    found = subprocess.run(
        [sys.executable, "-c", f"import {package}; print({package}.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()).resolve().is_relative_to(ROOT / package)
