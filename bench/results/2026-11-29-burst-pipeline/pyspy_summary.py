# Shares of a py-spy `--format raw` profile: inclusive by frame, then self. Usage: pyspy_summary.py PROFILE [PATTERN] [N]
import sys, collections
inc = collections.Counter(); self_ = collections.Counter(); total = 0
for line in open(sys.argv[1]):
    line = line.rstrip()
    if not line: continue
    stack, _, n = line.rpartition(" ")
    n = int(n); total += n
    frames = stack.split(";")
    seen = set()
    for f in frames:
        key = f.split(" (")[0] + " " + (f.split("(")[-1].split(":")[0].split("/")[-1] if "(" in f else "")
        if key not in seen:
            inc[key] += n; seen.add(key)
    last = frames[-1]
    self_[last.split(" (")[0] + " " + last.split("(")[-1].split(":")[0].split("/")[-1]] += n
print("total", total)
pat = sys.argv[2] if len(sys.argv) > 2 else None
for k, v in inc.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 70):
    if pat is None or pat in k: print(f"{100*v/total:5.1f}% {k}")
print("--- self")
for k, v in self_.most_common(25): print(f"{100*v/total:5.1f}% {k}")
