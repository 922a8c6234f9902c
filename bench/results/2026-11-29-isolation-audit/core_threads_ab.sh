#!/bin/bash
# A/B: the service's engine core with OMP_NUM_THREADS=$1 (or the default when "def"), one
# streaming bench run against it (with offline in the bench process, default threads).
cd /work/main
T=$1; OUT=$2
ENVSET=""; [ "$T" != def ] && ENVSET="OMP_NUM_THREADS=$T"
env $ENVSET .venv/bin/pagedq up --model /tmp/tinyl --device cpu --port 8124 --disable-uvicorn-access-log > $OUT.up.log 2>&1 &
U=$!
for i in $(seq 1 300); do grep -q "pagedq is up" $OUT.up.log && break; sleep 0.2; done
.venv/bin/pagedq bench serve --model /tmp/tinyl --url http://127.0.0.1:8124 --no-offline --num-prompts 64 --stream > /dev/null 2>&1
tree_cpu() { python3 - $U <<'PY'
import os, sys
def kids(p):
    out=[]
    for t in os.listdir(f"/proc/{p}/task"):
        try: out += [int(c) for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError: pass
    return out
tot=0; todo=[int(sys.argv[1])]; seen=[]
while todo:
    p=todo.pop(); seen.append(p)
    try:
        f=open(f"/proc/{p}/stat").read().rpartition(")")[2].split(); tot+=(int(f[11])+int(f[12]))/os.sysconf("SC_CLK_TCK")
        todo+=kids(p)
    except OSError: pass
print(f"{tot:.2f}")
PY
}
C0=$(tree_cpu)
uptime
.venv/bin/pagedq bench serve --model /tmp/tinyl --url http://127.0.0.1:8124 --num-prompts 512 --stream --json $OUT.serve.json > $OUT.bench.log 2>&1
C1=$(tree_cpu)
kill -INT $U; wait $U
python3 - $OUT.serve.json $C0 $C1 $T <<'PY'
import json,sys
d=json.load(open(sys.argv[1])); s=d["serve"]
o=d["offline"]; cpu=float(sys.argv[3])-float(sys.argv[2]); s.setdefault('engine_steps','?')
print(f"threads {sys.argv[4]}: serve {s['output_tokens_per_s']:.0f} tok/s, offline {o['output_tokens_per_s']:.0f} ({s['output_tokens_per_s']/o['output_tokens_per_s']:.2f}x); service CPU {cpu:.2f} s, offline {o['cpu_seconds']:.2f} s ({cpu/o['cpu_seconds']:.2f}x); TTFT p50 {s['ttft_ms']['p50']:.0f}; steps {s['engine_steps']}")
PY
