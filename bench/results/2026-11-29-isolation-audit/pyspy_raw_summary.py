"""Summarise a py-spy `--format raw` profile (lines "frame;frame;... count", root first): each
function's inclusive share of the samples, then the largest self shares.

    python pyspy_raw_summary.py PROFILE.txt [TOP]
"""
import collections
import sys

path = sys.argv[1]; top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
incl = collections.Counter(); selfc = collections.Counter(); total = 0
for line in open(path):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); total += n
    frames = stack.split(";")
    seen = set()
    for f in frames:
        key = f.split(" (")[0] + " " + f.split("/")[-1].split(":")[0] if "(" in f else f
        if key not in seen:
            incl[key] += n; seen.add(key)
    f = frames[-1]; selfc[f.split(" (")[0] + " " + f.split("/")[-1].split(":")[0]] += n
print("total samples", total)
print("-- inclusive")
for k, v in incl.most_common(top): print(f"{100*v/total:5.1f}% {k}")
print("-- self")
for k, v in selfc.most_common(25): print(f"{100*v/total:5.1f}% {k}")
