"""Where a verifier's time goes, from a py-spy raw profile (`py-spy record -p PID -r 1000 [--idle|--gil] -f raw
-o FILE`): microseconds per verifier round at each (thread, innermost treeserve frame, innermost frame), largest
first. "main" is the event loop's thread; every other thread is "thread".

    python docs/logs/2026-11-30-h200-round-host-profile.py PROFILE[.gz] ROUNDS [LINES]"""

import collections
import gzip
import sys

path, rounds = sys.argv[1], float(sys.argv[2])
lines = int(sys.argv[3]) if len(sys.argv) > 3 else 30
opened = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
by_line, by_thread = collections.Counter(), collections.Counter()
for line in opened:
    stack, _, samples = line.rstrip().rpartition(" ")
    frames = stack.split(";")
    ours = [frame for frame in frames if "treeserve" in frame]
    thread = "main" if "runpy" in frames[0] else "thread"
    by_thread[thread] += int(samples)
    by_line[(thread, ours[-1] if ours else "-", frames[-1])] += int(samples)
# 1000 samples a second: one sample is a millisecond of one thread.
print("all samples, us per round:", {thread: round(n / rounds * 1000) for thread, n in by_thread.items()})
for (thread, ours, innermost), n in by_line.most_common(lines):
    print(f"{n / rounds * 1000:9.1f} us  {thread:6s} {ours} || {innermost}")
