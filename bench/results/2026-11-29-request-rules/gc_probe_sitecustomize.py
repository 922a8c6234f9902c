# Temporary probe for gc_probe_run.sh (copied there as sitecustomize.py; not part of pagedq).
# Each process: its collections and CPU time per GC generation, written under /tmp/gcprobe/out every 0.5 s.
import gc, os, sys, threading, time
_start = {}
_stats = {0: [0, 0.0, 0], 1: [0, 0.0, 0], 2: [0, 0.0, 0]}
def _cb(phase, info):
    g = info["generation"]
    if phase == "start":
        _start[g] = time.thread_time()
    else:
        s = _stats[g]; s[0] += 1; s[1] += time.thread_time() - _start.get(g, time.thread_time()); s[2] += info.get("collected", 0)
gc.callbacks.append(_cb)
def _dump():
    name = "-".join(a for a in sys.argv[1:3] if not a.startswith("-"))[:40].replace("/", "_") or "proc"
    path = f"/tmp/gcprobe/out/{os.getpid()}-{name}"
    os.makedirs("/tmp/gcprobe/out", exist_ok=True)
    frozen = False
    while True:
        time.sleep(0.5)
        if not frozen and os.path.exists("/tmp/gcprobe/freeze"):
            gc.freeze(); frozen = True
            t = os.environ.get("GCTHRESH")
            if t: gc.set_threshold(*map(int, t.split(",")))
        with open(path, "w") as f:
            f.write(" ".join(f"gen{g}: {s[0]} runs {s[1]*1000:.0f} ms cpu" for g, s in _stats.items()) + f" objects {len(gc.get_objects()) if False else ''}\n")
threading.Thread(target=_dump, daemon=True).start()
