"""N requests at once (128-token prompts, 128 tokens out) to an api on port 8123, then each job's timings
against the burst's start: when the client sent it, the api enqueued it, the client got its 202, the worker
handed it to the engine, its first token, its end (ms, p0/p50/p90/p100):  python burst_timeline.py 256"""
import asyncio, aiohttp, sys, time, statistics
n = int(sys.argv[1])
async def main():
    conn = aiohttp.TCPConnector(limit=n)
    async with aiohttp.ClientSession("http://127.0.0.1:8123", connector=conn) as s:
        sent = {}; got = {}; ids = {}
        async def post(i):
            sent[i] = time.time()
            async with s.post("/generate", json={"prompt_token_ids": list(range(5, 133)), "max_tokens": 128, "ignore_eos": True}) as r:
                ids[i] = (await r.json())["seq_id"]
            got[i] = time.time()
        t0 = time.time()
        await asyncio.gather(*(post(i) for i in range(n)))
        res = {}
        async def get(i):
            async with s.get(f"/result/{ids[i]}", params={"wait": 60}) as r:
                res[i] = await r.json()
        await asyncio.gather(*(get(i) for i in range(n)))
        q = lambda xs: "p0 %4.0f p50 %4.0f p90 %4.0f p100 %4.0f" % tuple(1e3*x for x in (min(xs), statistics.median(xs), sorted(xs)[int(.9*len(xs))], max(xs)))
        print("client sent     ", q([sent[i]-t0 for i in range(n)]))
        print("api enqueued    ", q([res[i]["timings"]["enqueued"]-t0 for i in range(n)]))
        print("client got 202  ", q([got[i]-t0 for i in range(n)]))
        print("worker started  ", q([res[i]["timings"]["started"]-t0 for i in range(n)]))
        print("first token     ", q([res[i]["timings"]["first_token"]-t0 for i in range(n)]))
        print("finished        ", q([res[i]["timings"]["finished"]-t0 for i in range(n)]))
asyncio.run(main())
