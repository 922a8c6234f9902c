"""Per-step CPU of an engine core step log (step-log.patch), split by whether the step's
row count (padded) was new to the process: python new-row-counts.py SERVED.log OFFLINE.log"""
import sys
sys.path.insert(0, '.')  # run from the repository root
from worker.models.layers import padded_rows
for f in sys.argv[1:]:
    seen=set(); acc={}
    for line in open(f):
        t,th,flt,seqs,tok=line.split(); seqs=int(seqs); tok=int(tok); th=float(th); flt=int(flt)
        if tok==0: continue
        b=padded_rows(tok)
        k=("new" if b not in seen else "seen")+(" P" if tok>seqs else " D")
        seen.add(b)
        n,c,fl=acc.get(k,(0,0,0)); acc[k]=(n+1,c+th,fl+flt)
    print(f, {k:(n, round(c), round(c/n,2), 'faults/step', fl//n) for k,(n,c,fl) in sorted(acc.items())})
