import os, sys, atexit, time
if os.environ.get("STEPLOG_DIR"):
    try:
        import scheduler.scheduler as _s
        _orig = _s.Scheduler.schedule
        _log = []
        def schedule(self):
            out = _orig(self)
            if out.seqs:
                _log.append((time.monotonic(), len(out.seqs), out.num_tokens, len(self.waiting) if hasattr(self, "waiting") else -1))
            return out
        _s.Scheduler.schedule = schedule
        def _dump():
            with open(os.path.join(os.environ["STEPLOG_DIR"], f"steps-{os.getpid()}.txt"), "w") as f:
                f.write(" ".join(sys.argv) + "\n")
                for t, n, k, w in _log: f.write(f"{t:.4f} {n} {k} {w}\n")
        atexit.register(_dump)
    except Exception as e:
        print("steplog failed", e, file=sys.stderr)
