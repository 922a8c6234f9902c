# Who calls a frame in a py-spy raw profile. Usage: pyspy_callers.py PROFILE FRAME_PREFIX [DEPTH]
import sys, collections
target = sys.argv[2]; c = collections.Counter(); total = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    if not stack: continue
    n = int(n); total += n
    fr = stack.split(";")
    for i, f in enumerate(fr):
        if f.startswith(target):
            c[" <- ".join(x.split(" (")[0] + "(" + x.split("/")[-1] for x in reversed(fr[max(0, i-int(sys.argv[3]) if len(sys.argv) > 3 else i-3):i+1]))] += n
            break
for k, v in c.most_common(8): print(f"{100*v/total:5.2f}% {k}")
