import subprocess, sys, time, re, redis, os
p = subprocess.Popen(sys.argv[1:])
last = None
while p.poll() is None:
    time.sleep(1)
    out = subprocess.run(["pgrep", "-af", "redis-server"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.search(r"--port (\d+)", line) or re.search(r":(\d+)", line)
        if m and m.group(1) != "6379":
            try:
                last = redis.Redis(port=int(m.group(1))).info("commandstats")
            except Exception:
                pass
if last:
    rows = sorted(last.items(), key=lambda kv: -kv[1]["usec"])
    tot = sum(v["usec"] for _, v in rows)
    print(f"total {tot/1e6:.2f} s in commands")
    for k, v in rows[:14]:
        print(f"{k:28s} calls {v['calls']:8d} usec {v['usec']/1e6:6.2f} s  per {v['usec_per_call']:8.1f}")
