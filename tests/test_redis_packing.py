"""pagedq.redis_connection: the asyncio pools pack commands in C (hiredis), byte for byte as
redis-py's own Python packer does, for every kind of connection a URL can ask for."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.exceptions import DataError

from pagedq.redis_connection import async_connection_pool, connect_async
from pagedq.redis_server import RedisServer

COMMANDS = [
    ("SET", "key", "value"),
    ("EVAL", "return ARGV[1]", 1, "k", 2**70, -3, 0.1, 1e20, 1.5e-7, float("inf"), b"\x00\xffbytes", "ünïcode"),
    ("CONFIG GET", "maxmemory"),
    ("XREAD", "COUNT", 512, "STREAMS", *(f"stream:{i}" for i in range(300)), *("0-0" for _ in range(300))),
]


@pytest.mark.parametrize("url, kind", [
    ("redis://127.0.0.1:6379/0", Connection), ("rediss://127.0.0.1:6379/0", SSLConnection),
    ("unix:///tmp/redis.sock", UnixDomainSocketConnection),
    ("redis+sentinel://127.0.0.1:26379/mymaster", SentinelManagedConnection),
])
def test_every_kind_of_asyncio_connection_packs_what_redis_py_packs(url, kind):
    pool = async_connection_pool(url, max_connections=2, timeout=1)
    connection = pool.make_connection()  # not connected: packing needs no server
    assert isinstance(connection, kind) and type(connection) is not kind
    python_packer = Connection()  # redis-py's own asyncio packing, in Python
    for command in COMMANDS:
        assert b"".join(connection.pack_command(*command)) == b"".join(python_packer.pack_command(*command))
    with pytest.raises(DataError):
        connection.pack_command("SET", "key", True)


def test_a_pipeline_round_trip_through_the_c_packer(tmp_path):
    server = RedisServer(tmp_path / "redis").start()

    async def run() -> list:
        connection = connect_async(server.url, max_connections=2, timeout=1)
        try:
            async with connection.pipeline(transaction=False) as pipeline:
                pipeline.set("n", 3).incrbyfloat("n", 0.25).eval("return ARGV[1]", 0, "ünïcode").xadd("s", {"f": b"\xff"})
                replies = await pipeline.execute()
            return replies[:3] + [await connection.xrange("s")]
        finally:
            await connection.aclose()

    try:
        set_, incremented, echoed, entries = asyncio.run(run())
    finally:
        server.stop()
    assert (set_, incremented, echoed.decode()) == (True, 3.25, "ünïcode")
    assert entries[0][1] == {b"f": b"\xff"}
