"""API CPU per request by endpoint: starts redis + `pagedq api`, fires N requests (64 concurrent), reads the api's CPU."""
import asyncio, os, subprocess, sys, time, tempfile, pathlib
import aiohttp
from pagedq.redis_server import RedisServer, free_port

def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

async def fire(url, method, n, body=None, conc=64):
    sem = asyncio.Semaphore(conc)
    codes = {}
    async with aiohttp.ClientSession() as s:
        async def one():
            async with sem:
                async with s.request(method, url, json=body) as r:
                    await r.read(); codes[r.status] = codes.get(r.status, 0) + 1
        await asyncio.gather(*(one() for _ in range(n)))
    return codes


def main():
    server = RedisServer(pathlib.Path(tempfile.mkdtemp())).start()
    port = free_port()
    env = dict(os.environ, PAGEDQ_REDIS_URL=server.url, PAGEDQ_MODEL="/tmp/tinyl", PAGEDQ_PORT=str(port))
    extra = sys.argv[1:]
    api = subprocess.Popen([sys.executable, "-m", "pagedq.cli", "api", "--port", str(port), *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            import urllib.request; urllib.request.urlopen(base + "/health"); break
        except Exception: time.sleep(0.1)
    N = 2000
    cases = [("GET /health", "GET", "/health", None), ("GET /result/<unknown>", "GET", "/result/" + "a" * 32, None),
             ("POST /generate", "POST", "/generate", {"prompt": "Hello there, how are you today? " * 4, "max_tokens": 16}),
             ("POST /generate ids", "POST", "/generate", {"prompt_token_ids": list(range(5, 133)), "max_tokens": 16})]
    asyncio.run(fire(base + "/health", "GET", 200))
    for rnd in range(int(os.environ.get("ROUNDS", "2"))):
        for name, method, path, body in [c for c in cases if os.environ.get("ONLY", "") in c[0]]:
            c0 = cpu(api.pid)
            codes = asyncio.run(fire(base + path, method, N, body))
            c1 = cpu(api.pid)
            print(f"{name:24s} {(c1 - c0) / N * 1e6:7.0f} us CPU/request  {codes}  load {open('/proc/loadavg').read().split()[0]}")
    api.terminate(); api.wait(); server.stop()


if __name__ == "__main__":
    main()
