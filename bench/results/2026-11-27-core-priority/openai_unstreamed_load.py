import asyncio, aiohttp, os, random, subprocess, sys, time, signal
tree, port = sys.argv[1], int(sys.argv[2])
env = dict(os.environ, PAGEDQ_MAX_QUEUE_DEPTH="2000")
up = subprocess.Popen(["/work/main/.venv/bin/python", "-m", "pagedq.cli", "up", "--model", "/tmp/tinyl", "--port", str(port)],
                      cwd=tree, env=env, stdout=open("/tmp/tl/oai-up.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
def pids(pat):
    return [int(p) for p in subprocess.run(["pgrep", "-f", pat], capture_output=True, text=True).stdout.split()]
async def main():
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for _ in range(600):
            try:
                async with s.get(base + "/ready") as r:
                    if r.status == 200: break
            except Exception: pass
            await asyncio.sleep(1)
        rng = random.Random(0)
        async def one(n):
            body = {"model": "/tmp/tinyl", "prompt": [rng.randrange(10, 500) for _ in range(rng.randint(32, 256))],
                    "max_tokens": n, "ignore_eos": True, "temperature": 0.6}
            async with s.post(base + "/v1/completions", json=body) as r:
                d = await r.json()
                if "usage" not in d: print(d); raise SystemExit(1)
                return d["usage"]["completion_tokens"]
        await one(4)
        worker = [p for p in pids("cli worker") if p != os.getpid()]
        core = pids("pagedq.core.process"); api = pids("cli api")
        before = {k: sum(cpu(p) for p in v) for k, v in (("worker", worker), ("core", core), ("api", api))}
        t = time.time()
        toks = await asyncio.gather(*(one(rng.randint(32, 256)) for _ in range(512)))
        wall = time.time() - t
        after = {k: sum(cpu(p) for p in v) for k, v in (("worker", worker), ("core", core), ("api", api))}
        print(f"{tree}: {sum(toks)} tokens in {wall:.2f} s ({sum(toks)/wall:,.0f} tok/s); CPU s:",
              {k: round(after[k] - before[k], 2) for k in after}, "load", os.getloadavg()[0])
try:
    asyncio.run(main())
finally:
    os.killpg(up.pid, signal.SIGINT); up.wait(60)
