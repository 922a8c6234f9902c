"""Shared fixtures.

`tiny_model_dir(arch="llama", **kwargs) -> Path` builds a random-weight checkpoint with
`pagedq.tiny_model.make_tiny_model` (same keyword arguments: preset, seed, dtype,
max_shard_size, and transformers config overrides such as `num_hidden_layers=3` or
`tie_word_embeddings=True`). Each distinct set of arguments is built once per test session;
treat the directory as read-only (copy it before editing files in it).

`tiny_arch` is parametrized over every architecture `make_tiny_model` can write, so a
test taking it runs once per architecture.

`redis_server` is a Redis server of the test module's own (pagedq.redis_server.RedisServer,
started on a free port), and `redis` a client of it.

Processes the tests start with a fresh HOME (a first run's own caches: `pagedq up`, the README's
quick start, `pagedq pull`) share this session's build of the C++ CPU kernels
(TORCH_EXTENSIONS_DIR, set here unless the caller set it): each would otherwise compile them
again, half a minute to a minute of a 2-core machine's time apiece.

`overlap` is parametrized over the engine core's two ways of stepping: each step
collected before the next is scheduled, and overlapped steps (`async_scheduling`: step
N+1 scheduled and launched before step N's tokens are known on the host). A test taking
it passes it to the engine and runs once each way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from redis import Redis
from torch.utils.cpp_extension import get_default_build_root

from pagedq.redis_server import RedisServer
from pagedq.tiny_model import TINY_ARCHS, make_tiny_model

os.environ.setdefault("TORCH_EXTENSIONS_DIR", get_default_build_root())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    built: dict[str, Path] = {}

    def build(arch: str = "llama", **kwargs) -> Path:
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in built:
            built[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kwargs)
        return built[key]

    return build


@pytest.fixture(params=TINY_ARCHS)
def tiny_arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def overlap(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis(redis_server) -> Redis:
    return Redis.from_url(redis_server.url)
