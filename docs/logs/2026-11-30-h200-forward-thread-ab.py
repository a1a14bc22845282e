"""A/B of where the verifier runs its forward, in one running stack: patch a copy of services/verifier/server.py so
that each round takes the former path (the whole forward_batch in a worker thread) while the file FLAG exists,
and the committed one (`Scheduler._forward`) otherwise. Start the stack on the patched copy, then restore it.

    python docs/logs/2026-11-30-h200-forward-thread-ab.py SERVER_PY patch FLAG | restore"""

import shutil
import sys

path, action = sys.argv[1], sys.argv[2]
if action == "restore":
    shutil.copy(path + ".orig", path)
    sys.exit()
flag = sys.argv[3]
shutil.copy(path, path + ".orig")
source = open(path).read()
committed = "            logits, features = await self._forward(list(plans.values()))"
switchable = f"""            import os
            if os.path.exists({flag!r}):
                logits, features = await asyncio.to_thread(forward_batch, self.target.model, list(plans.values()),
                                                           self.feature_layer_ids, self.verifier)
            else:
                logits, features = await self._forward(list(plans.values()))"""
assert committed in source
open(path, "w").write(source.replace(committed, switchable))
