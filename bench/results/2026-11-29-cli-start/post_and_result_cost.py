"""CPU per request of a running api (port 8123, its PID given) for N POST /generate (max_tokens 1), then N GET
/result of those finished jobs, 64 at a time:  python post_and_result_cost.py 1000 API_PID"""
import asyncio, aiohttp, sys, time, os
n = int(sys.argv[1]); pid = int(sys.argv[2])
def cpu(p):
    f = open(f"/proc/{p}/stat").read().rsplit(")",1)[1].split(); return (int(f[11])+int(f[12]))/os.sysconf("SC_CLK_TCK")
async def main():
    async with aiohttp.ClientSession("http://127.0.0.1:8123") as s:
        sem = asyncio.Semaphore(64)
        ids = []
        async def post(i):
            async with sem:
                async with s.post("/generate", json={"prompt": f"hello world number {i} " * 8, "max_tokens": 1}) as r:
                    ids.append((await r.json())["seq_id"])
        async def get(i):
            async with sem:
                async with s.get(f"/result/{i}") as r: await r.read()
        await asyncio.gather(*(post(i) for i in range(200)))
        await asyncio.sleep(3)
        c0 = cpu(pid); t = time.perf_counter(); ids.clear()
        await asyncio.gather(*(post(i) for i in range(n)))
        dt = time.perf_counter() - t; c = cpu(pid) - c0
        print(f"POST /generate: {n/dt:.0f} req/s, api CPU {c*1e6/n:.0f} us/request")
        await asyncio.sleep(5)
        c0 = cpu(pid); t = time.perf_counter()
        await asyncio.gather(*(get(i) for i in ids))
        dt = time.perf_counter() - t; c = cpu(pid) - c0
        print(f"GET /result (finished): {n/dt:.0f} req/s, api CPU {c*1e6/n:.0f} us/request")
asyncio.run(main())
