"""Each run's garbage collections in each service, from an A/B folder of docs/logs/2026-12-01-h200-gc-freeze-ab.sh:
per arm and run, the collections of generations 0, 1 and 2 and their milliseconds, beside the run's tok/s and
round time.
    python docs/logs/2026-12-01-gc-stats/per_run.py docs/figures/gc-freeze-h200"""

import bisect
import json
import sys
from pathlib import Path

folder = Path(sys.argv[1])
for arm in ("unfrozen", "frozen"):
    times = [line.split() for line in (folder / arm / "times").read_text().splitlines()]
    runs = [json.loads(line) for line in (folder / arm / "runs.jsonl").read_text().splitlines()]
    windows = [(times[i][0], float(times[i][2]), float(times[i + 1][2])) for i in range(0, len(times), 2)]
    for path in sorted((folder / arm / "gc").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        stamps = [row["time"] for row in rows]

        def totals_at(moment):
            i = bisect.bisect_right(stamps, moment) - 1
            return rows[i] if i >= 0 else {"seconds": [0.0] * 3, "collections": [0] * 3}

        for (mode, start, end), run in zip(windows, runs):
            before, after = totals_at(start), totals_at(end)
            counts = [b - a for a, b in zip(before["collections"], after["collections"])]
            ms = [round((b - a) * 1e3, 1) for a, b in zip(before["seconds"], after["seconds"])]
            print(f"{arm:8} {path.stem:8} {mode:5} tok/s {run['tok_s']:7} round {run['round_ms']['round']:.2f} ms  "
                  f"collections {counts} ms {ms}")
