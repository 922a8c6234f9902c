"""Many clients of one job's stream against a running api: /health latency and a bystander's gaps.

usage: fanout_probe.py URL [--followers 200] [--mode never|read] [--seconds 20]
One long job (ignore_eos, 30,000 tokens) is followed by N raw-socket clients that either
never read (mode never) or read everything (mode read); /health is timed every 0.2 s from
before the first follower joins, and a bystander job streams 300 greedy tokens (its longest
gap between events)."""
import argparse, json, socket, statistics, threading, time
import httpx

p = argparse.ArgumentParser()
p.add_argument("url"); p.add_argument("--followers", type=int, default=200)
p.add_argument("--mode", default="never"); p.add_argument("--late", type=float, default=0.0); p.add_argument("--seconds", type=float, default=20)
a = p.parse_args()
host, port = a.url.split("//")[1].split(":"); port = int(port)
c = httpx.Client(base_url=a.url, timeout=60)
stop = threading.Event()
lat = []
T0 = time.monotonic()
def prober():
    pc = httpx.Client(base_url=a.url, timeout=120)
    while not stop.is_set():
        t = time.monotonic(); pc.get("/health"); lat.append(time.monotonic() - t)
        if lat[-1] > 0.1: print(f"  slow /health {lat[-1]*1000:.0f} ms, sent at {t-T0:.2f} s", flush=True)
        time.sleep(0.2)
def reader(s):
    while not stop.is_set():
        try:
            if not s.recv(65536): return
        except OSError: return
th = threading.Thread(target=prober, daemon=True); th.start()
time.sleep(1.0)
big = c.post("/generate", json={"prompt": "a b c", "max_tokens": 30000, "ignore_eos": True, "temperature": 0.8}).json()
sid = big["seq_id"]
time.sleep(a.late)  # followers join a job this far into its run
socks = []
for i in range(a.followers):
    s = socket.create_connection((host, port))
    s.sendall(f"GET /stream/{sid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    socks.append(s)
    if a.mode == "read":
        threading.Thread(target=reader, args=(s,), daemon=True).start()
print(f"{a.followers} followers ({a.mode}) joined from 1.00 to {time.monotonic()-T0:.2f} s", flush=True)
time.sleep(1.0)
tb = time.monotonic()
by = c.post("/generate", json={"prompt": "x y", "max_tokens": 300, "ignore_eos": True, "temperature": 0}).json()["seq_id"]
gaps = []; last = time.monotonic(); ntok = 0
with c.stream("GET", f"/stream/{by}") as r:
    for line in r.iter_lines():
        if line.startswith("data:"):
            now = time.monotonic(); gaps.append(now - last); last = now
            d = json.loads(line[5:])
            if "num_tokens" in d: ntok = d["num_tokens"]
print(f"bystander (from {tb-T0:.2f} s): {ntok} tokens in {time.monotonic()-tb:.2f} s, longest gap {max(gaps):.3f} s", flush=True)
rest = a.seconds - (time.monotonic() - T0)
if rest > 0: time.sleep(rest)
stop.set(); th.join(timeout=130)
c.delete(f"/result/{sid}")
for s in socks: s.close()
print(f"/health: {len(lat)} probes, p50 {statistics.median(lat)*1000:.1f} ms, max {max(lat)*1000:.1f} ms")
