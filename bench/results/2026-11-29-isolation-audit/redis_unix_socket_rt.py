"""CPU per pipelined Redis round trip like a worker's (8 XADDs and a GET), over TCP loopback and over a
Unix socket, client and redis-server, 3 alternated rounds: python redis_unix_socket_rt.py [N]."""
import os, sys, time, subprocess, redis
def proc_cpu(pid):
    f = open(f"/proc/{pid}/stat").read().split(")")[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
srv = subprocess.Popen(["redis-server", "--port", "6411", "--bind", "127.0.0.1", "--unixsocket", "/tmp/ux/r.sock", "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
time.sleep(0.5)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
payload = b"x" * 300
for rnd in range(3):
    for name, url in (("tcp", "redis://127.0.0.1:6411/0"), ("unix", "unix:///tmp/ux/r.sock?db=0")):
        r = redis.Redis.from_url(url)
        r.ping()
        c0 = time.process_time(); s0 = proc_cpu(srv.pid); t0 = time.time()
        for i in range(N):
            p = r.pipeline(transaction=False)
            for j in range(8):
                p.xadd(f"s{j}", {"d": payload}, maxlen=100, approximate=True)
            p.get("k")
            p.execute()
        c1 = time.process_time(); s1 = proc_cpu(srv.pid); t1 = time.time()
        print(f"round {rnd} {name}: client {1e6*(c1-c0)/N:.0f} us, server {1e6*(s1-s0)/N:.0f} us per round trip, wall {1e6*(t1-t0)/N:.0f} us", flush=True)
        r.close()
srv.terminate(); srv.wait()
