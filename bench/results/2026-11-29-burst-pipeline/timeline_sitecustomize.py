# Temporary timeline of a `pagedq bench serve` run (not part of the service): put this folder on
# PYTHONPATH and set TL_DIR to a folder; each process writes tl-<pid>.txt (event, monotonic time, details):
# engine steps (core), POST parses / prepares / enqueue replies / request turns / shared round trips (api),
# jobs taken / start_jobs wall and CPU / hand-offs (worker). TL_SWITCH: the worker's GIL switch interval;
# TL_EXEC: log the I/O thread's pipelines; the worker and core also log per-thread CPU ticks every 0.25 s.
import os, sys, time
D = os.environ.get("TL_DIR")
if D:
    argv = " ".join(sys.argv)
    _f = open(os.path.join(D, f"tl-{os.getpid()}.txt"), "w", buffering=1)
    _f.write(argv[:200] + "\n")
    def log(*row): _f.write(" ".join(map(str, row)) + "\n")
    try:
        import scheduler.scheduler as _s
        S = _s.Scheduler; o = S.schedule
        def schedule(self):
            out = o(self)
            if out.seqs: log("step", f"{time.monotonic():.4f}", len(out.seqs), out.num_tokens)
            return out
        S.schedule = schedule
    except Exception as e: log("err", e)
    try:
        import api.jobs as _j
        J = _j.JobStore; op, os_ = J.prepare, J.settle
        def prepare(self, *a, **k):
            log("prep", f"{time.monotonic():.4f}"); return op(self, *a, **k)
        def settle(self, *a, **k):
            log("settle", f"{time.monotonic():.4f}"); return os_(self, *a, **k)
        J.prepare, J.settle = prepare, settle
        import uvicorn.protocols.http.httptools_impl as _h
        H = _h.HttpToolsProtocol; oc, om = H.connection_made, H.on_message_complete
        def connection_made(self, t):
            log("conn", f"{time.monotonic():.4f}"); return oc(self, t)
        def on_message_complete(self):
            log("msg", f"{time.monotonic():.4f}"); return om(self)
        H.connection_made, H.on_message_complete = connection_made, on_message_complete
    except Exception as e: log("err", e)
    try:
        import api.turns as _t
        T = _t.RequestTurns; onew = T._new_turn
        def _new_turn(self):
            log("turn", f"{time.monotonic():.4f}", len(self._waiting)); return onew(self)
        T._new_turn = _new_turn
        import api.shared_round_trip as _r
        R = _r.SharedRoundTrip; osend = R._send_waiting
        async def _send_waiting(self):
            log("flush", f"{time.monotonic():.4f}", len(self._waiting))
            return await osend(self)
        R._send_waiting = _send_waiting
    except Exception as e: log("err", e)
    if "worker" in argv:
        try:
            import worker.rq.round_trip as _w
            RR = _w.RoundTripReplies; ord_ = RR.read.__func__
            def read(cls, replies, published, successes):
                r = ord_(cls, replies, published, successes)
                if not isinstance(r.sync, Exception) and r.sync.taken: log("taken", f"{time.monotonic():.4f}", len(r.sync.taken))
                return r
            RR.read = classmethod(read)
            RT = _w.RoundTrips; ots = RT.take_started
            def take_started(self):
                s = ots(self)
                if s: log("handed", f"{time.monotonic():.4f}", len(s))
                return s
            RT.take_started = take_started
        except Exception as e: log("err", e)
    if "worker" in argv:
        try:
            import worker.rq.batch_worker as _bw
            osj = _bw.start_jobs
            def start_jobs(connection, ids, *a, **k):
                w0, c0 = time.monotonic(), time.thread_time()
                r = osj(connection, ids, *a, **k)
                log("startjobs", f"{w0:.4f}", len(ids), f"wall_ms={1000*(time.monotonic()-w0):.1f}", f"cpu_ms={1000*(time.thread_time()-c0):.1f}")
                return r
            _bw.start_jobs = start_jobs
        except Exception as e: log("err", e)
    if "worker" in argv and os.environ.get("TL_SWITCH"):
        sys.setswitchinterval(float(os.environ["TL_SWITCH"]))
    if "worker" in argv or "process.py" in argv:
        import threading
        def _threads():
            import glob as g
            while True:
                time.sleep(0.25)
                rows = []
                for d in g.glob(f"/proc/{os.getpid()}/task/*"):
                    try:
                        st = open(d + "/stat").read()
                        name = st[st.index("(")+1:st.rindex(")")]
                        f = st[st.rindex(")")+2:].split()
                        rows.append(f"{name}:{int(f[11])+int(f[12])}")
                    except Exception: pass
                log("threads", f"{time.monotonic():.4f}", *rows)
        threading.Thread(target=_threads, daemon=True).start()
    if "worker" in argv and os.environ.get("TL_EXEC"):
        import redis.client as _rc, threading as _th
        oexe = _rc.Pipeline.execute
        def execute(self, *a, **k):
            w0, c0 = time.monotonic(), time.thread_time()
            n = len(self.command_stack)
            try: return oexe(self, *a, **k)
            finally:
                if _th.current_thread().name.startswith("redis-io"):
                    log("exec", f"{w0:.4f}", n, f"wall_ms={1000*(time.monotonic()-w0):.1f}", f"cpu_ms={1000*(time.thread_time()-c0):.1f}")
        _rc.Pipeline.execute = execute
