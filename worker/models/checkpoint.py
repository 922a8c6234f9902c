"""Reading a Hugging Face safetensors checkpoint: one `model.safetensors`, or shards named
by `model.safetensors.index.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        if (model_dir / INDEX_FILE).is_file():
            weight_map: dict[str, str] = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
            self.files = [model_dir / name for name in sorted(set(weight_map.values()))]
            self.names = frozenset(weight_map)
        elif (model_dir / SINGLE_FILE).is_file():
            self.files = [model_dir / SINGLE_FILE]
            with safe_open(self.files[0], framework="pt") as f:
                self.names = frozenset(f.keys())
        else:
            raise ValueError(f"model: {str(model_dir)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        missing = [str(path) for path in self.files if not path.is_file()]
        if missing:
            raise ValueError(f"model: checkpoint shards listed in {INDEX_FILE} are missing: {missing}")

    def tensors(self) -> Iterator[tuple[str, object]]:
        """Every (name, lazy slice): indexing a slice reads just those elements from the
        file, so at most one tensor (under tensor parallelism, one rank's part of it) is
        staged in host memory."""
        for path in self.files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name)
