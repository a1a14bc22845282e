"""Imported at startup by every Python process with this folder on PYTHONPATH (an experiment, not part of
treeserve): with GC_STATS_DIR set, each process appends, at most twice a second after a collection, its garbage
collector's totals (collections and seconds per generation) to GC_STATS_DIR/<pid>.jsonl; with GC_FREEZE_OFF=1,
gc.freeze() does nothing, which undoes `serving.freeze_startup_objects` for an A/B run."""

import gc
import json
import os
import sys
import time

if os.environ.get("GC_FREEZE_OFF") == "1":
    gc.freeze = lambda: None

if os.environ.get("GC_STATS_DIR"):
    _path = os.path.join(os.environ["GC_STATS_DIR"], f"{os.getpid()}.jsonl")
    _seconds, _counts, _state = [0.0, 0.0, 0.0], [0, 0, 0], {"started": 0.0, "written": 0.0}

    def _on_collection(phase, info):
        if phase == "start":
            _state["started"] = time.perf_counter()
            return
        generation = info["generation"]
        _seconds[generation] += time.perf_counter() - _state["started"]
        _counts[generation] += 1
        now = time.time()
        if now - _state["written"] > 0.5 or generation == 2:
            _state["written"] = now
            with open(_path, "a") as out:
                out.write(json.dumps({"argv": " ".join(sys.argv)[:120], "time": now, "seconds": _seconds,
                                      "collections": _counts, "frozen": gc.get_freeze_count()}) + "\n")

    gc.callbacks.append(_on_collection)
