"""Batch sizes over a run's first seconds, from the step logs sitecustomize.py writes:
`python summarize.py base-core-steps.txt head-core-steps.txt`. The timed run is taken
as what follows the last pause of over a second (the warm-up comes before it)."""
import sys

for path in sys.argv[1:]:
    lines = open(path).read().split("\n")
    rows = [(float(t), int(n), int(k)) for t, n, k, _ in (line.split() for line in lines[1:] if line)]
    gaps = [i for i in range(1, len(rows)) if rows[i][0] - rows[i - 1][0] > 1.0]
    if gaps:
        rows = rows[gaps[-1]:]
    t0 = rows[0][0]
    print(f"{path}: {len(rows)} steps in {rows[-1][0] - t0:.2f} s")
    for a in range(6):
        part = [r for r in rows if a * 0.25 <= r[0] - t0 < (a + 1) * 0.25]
        if part:
            print(f"  {a * 0.25:.2f}-{(a + 1) * 0.25:.2f} s: {len(part):4d} steps, {sum(r[1] for r in part) / len(part):6.1f} "
                  f"sequences and {sum(r[2] for r in part) / len(part):7.1f} tokens a step")
