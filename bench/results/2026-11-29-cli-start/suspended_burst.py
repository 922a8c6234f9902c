"""512 jobs (tiny model's bench workload shape) into a running `pagedq up` on port 8123, either with the
workers suspended until all are queued (the engine gets them at once, as offline does) or as a plain burst;
prints the engine core's and worker's CPU seconds for the run. python suspended_burst.py REDIS_URL suspended|burst"""
import asyncio, aiohttp, os, random, subprocess, sys, time
from redis import Redis
from rq.suspension import suspend, resume
url, mode = sys.argv[1], sys.argv[2]
def cpu(pattern):
    pid = int(subprocess.check_output(["pgrep", "-f", pattern]).split()[0])
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split(); return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
rng = random.Random()  # new prompts each run: no prefix-cache hits from an earlier one
bodies = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(rng.randint(32, 256))], "max_tokens": rng.randint(32, 256),
           "ignore_eos": True, "temperature": 0.6, "seed": i} for i in range(512)]
async def main():
    redis = Redis.from_url(url)
    async with aiohttp.ClientSession("http://127.0.0.1:8123", connector=aiohttp.TCPConnector(limit=512)) as s:
        if mode == "suspended":
            suspend(redis); await asyncio.sleep(3)
        core0, worker0, t0 = cpu("pagedq.core.process"), cpu("pagedq.cli worker"), time.time()
        async def post(b):
            async with s.post("/generate", json=b) as r:
                j = await r.json()
                assert "seq_id" in j, (r.status, j)
                return j["seq_id"]
        ids = await asyncio.gather(*(post(b) for b in bodies))
        if mode == "suspended":
            resume(redis)
        async def get(i):
            async with s.get(f"/result/{i}", params={"wait": 120}) as r: return (await r.json())["status"]
        states = await asyncio.gather(*(get(i) for i in ids))
        print(f"{mode}: {states.count('finished')}/512 finished in {time.time() - t0:.2f} s; core CPU {cpu('pagedq.core.process') - core0:.2f} s, "
              f"worker CPU {cpu('pagedq.cli worker') - worker0:.2f} s")
asyncio.run(main())
