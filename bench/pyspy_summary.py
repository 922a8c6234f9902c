"""Where each process of a `py-spy record --subprocesses --format raw` profile spent its CPU.

    python bench/pyspy_summary.py PROFILE[.gz] [--top N] [--match TEXT]

For each process (named by its command line): its samples, then the functions with the most
samples anywhere on the stack (inclusive) and at the top of it (self). --match keeps only
frames whose text contains TEXT in the inclusive list (e.g. a package name); --drop leaves
out the samples of startup (imports, model loading) to see the serving alone.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter, defaultdict

_PROCESS = re.compile(r'^process \d+:"(.*)"$')


def _name(command: str) -> str:
    for marker in ("pagedq.cli ", "pagedq.core.process", "redis-server"):
        if marker in command:
            return command[command.index(marker):][:60]
    return command[-60:] or "(bench client)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--match", default="")
    parser.add_argument("--drop", action="append", default=[],
                        help="leave out samples with a frame containing this text (startup: importlib, create_app)")
    args = parser.parse_args()
    opener = gzip.open if args.profile.endswith(".gz") else open
    total: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    top: dict[str, Counter[str]] = defaultdict(Counter)
    with opener(args.profile, "rt") as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            process = "(bench client)"
            while frames and (match := _PROCESS.match(frames[0])):
                process = _name(match.group(1))
                frames.pop(0)
            frames = frames[1:] if frames and frames[0].startswith("thread") else frames
            if any(drop in frame for drop in args.drop for frame in frames):
                continue
            samples = int(count)
            total[process] += samples
            for frame in set(frames):
                if args.match in frame:
                    inclusive[process][frame] += samples
            if frames:
                top[process][frames[-1]] += samples
    for process, samples in total.most_common():
        print(f"\n## {process}: {samples} samples")
        print("  inclusive:")
        for frame, n in inclusive[process].most_common(args.top):
            print(f"    {n / samples:6.1%}  {frame}")
        print("  self:")
        for frame, n in top[process].most_common(args.top // 2):
            print(f"    {n / samples:6.1%}  {frame}")


if __name__ == "__main__":
    main()
