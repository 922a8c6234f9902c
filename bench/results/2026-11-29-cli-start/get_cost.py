"""CPU per request of an api process (its /proc times) for N GETs of PATH, 64 at a time, after 200 to warm up:
    python get_cost.py /health 3000 API_PID   (PORT=8124 for another port than 8123)"""
import asyncio, aiohttp, sys, time, os
path = sys.argv[1]; n = int(sys.argv[2]); pid = int(sys.argv[3])
def cpu(p):
    f = open(f"/proc/{p}/stat").read().rsplit(")",1)[1].split(); return (int(f[11])+int(f[12]))/os.sysconf("SC_CLK_TCK")
async def main():
    async with aiohttp.ClientSession("http://127.0.0.1:" + os.environ.get("PORT","8123") + "") as s:
        sem = asyncio.Semaphore(64)
        async def one():
            async with sem:
                async with s.get(path) as r: await r.read()
        await asyncio.gather(*(one() for _ in range(200)))
        c0 = cpu(pid); t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        dt = time.perf_counter() - t; c = cpu(pid) - c0
        print(f"{path}: {n/dt:.0f} req/s, api CPU {c*1e6/n:.0f} us/request")
asyncio.run(main())
