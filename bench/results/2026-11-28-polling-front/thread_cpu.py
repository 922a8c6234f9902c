"""Poll /proc for pagedq worker/api/core processes; keep each thread's last CPU reading; print at end."""
import os, sys, time, subprocess
last = {}
def scan():
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            cmd = open(f'/proc/{pid}/cmdline','rb').read().replace(b'\0',b' ').decode()
        except OSError: continue
        name = next((m for m in ('cli worker','cli api','core.process','redis-server') if m in cmd), None)
        if not name: continue
        try: tids = os.listdir(f'/proc/{pid}/task')
        except OSError: continue
        for tid in tids:
            try:
                comm = open(f'/proc/{pid}/task/{tid}/comm').read().strip()
                f = open(f'/proc/{pid}/task/{tid}/stat').read().rpartition(')')[2].split()
            except OSError: continue
            last[(name, pid, tid, comm)] = (int(f[11]) + int(f[12])) / 100
p = subprocess.Popen(sys.argv[1:])
while p.poll() is None:
    scan(); time.sleep(0.3)
agg = {}
for (name, pid, tid, comm), s in last.items():
    agg[(name, tid)] = agg.get((name, tid), 0) + s
for k, v in sorted(agg.items()):
    if v >= 0.05: print(f'{k[0]:14s} {k[1]:20s} {v:6.2f}')
