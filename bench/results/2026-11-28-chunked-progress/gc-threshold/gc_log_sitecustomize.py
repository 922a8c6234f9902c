import os, sys, atexit, time, gc
if os.environ.get("GCLOG_DIR") and "bench" not in sys.argv and ("worker" in sys.argv or "api" in sys.argv or any("core" in a for a in sys.argv) or sys.argv[:1] == ["-m"]):
    role = "worker" if "worker" in sys.argv else "api" if "api" in sys.argv else "core"
    stats = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    t = [0.0, 0.0]
    def cb(phase, info):
        if phase == "start":
            t[0] = time.thread_time()
        else:
            s = stats[info["generation"]]; s[0] += 1; s[1] += time.thread_time() - t[0]
    gc.callbacks.append(cb)
    _freeze = gc.freeze
    def freeze():
        _freeze()
        for v in stats.values(): v[0] = 0; v[1] = 0.0
        t[1] = time.process_time()
    gc.freeze = freeze
    def dump():
        with open(os.path.join(os.environ["GCLOG_DIR"], f"gc-{role}-{os.getpid()}.txt"), "w") as f:
            f.write(f"{role} {stats} threshold {gc.get_threshold()} cpu since freeze {time.process_time() - t[1]:.2f}\n")
    import threading
    def loop():
        while True:
            time.sleep(2); dump()
    threading.Thread(target=loop, daemon=True).start()
    atexit.register(dump)
