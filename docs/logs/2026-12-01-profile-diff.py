"""Two py-spy raw profiles of a verifier (`py-spy record ... -f raw`), one plain run and one speculative run:
microseconds per round that the speculative run spent more at each (innermost treeserve frame, innermost frame),
largest first. ROUNDS: each run's verifier rounds.

    python docs/logs/2026-12-01-profile-diff.py PLAIN.txt.gz PLAIN_ROUNDS SPEC.txt.gz SPEC_ROUNDS [LINES]"""

import collections
import gzip
import sys


def per_round(path: str, rounds: float) -> collections.Counter:
    found = collections.Counter()
    for line in gzip.open(path, "rt") if path.endswith(".gz") else open(path):
        stack, _, samples = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        ours = [frame for frame in frames if "treeserve" in frame]
        found[(ours[-1] if ours else "-", frames[-1])] += int(samples) / rounds * 1000  # 1000 samples a second
    return found


plain = per_round(sys.argv[1], float(sys.argv[2]))
spec = per_round(sys.argv[3], float(sys.argv[4]))
lines = int(sys.argv[5]) if len(sys.argv) > 5 else 25
for key in sorted(plain.keys() | spec.keys(), key=lambda key: plain[key] - spec[key])[:lines]:
    print(f"{spec[key] - plain[key]:8.1f} us  (speculative {spec[key]:8.1f}, plain {plain[key]:8.1f})  "
          f"{key[0]} || {key[1]}")
