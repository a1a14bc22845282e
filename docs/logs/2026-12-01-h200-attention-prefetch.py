"""Issue 5: the tree-attention sweep (treeserve.verifier.attention_sweep, its default shapes) with and without
loading each tile's keys and values one tile ahead, around the settings that won before. From the repository
root on the H200: python3 docs/logs/2026-12-01-h200-attention-prefetch.py --out attention-prefetch.json"""
import sys
from treeserve.verifier import attention_sweep

attention_sweep.SETTINGS = {"query_rows": (64,), "block_n": (32, 64), "num_warps": (4,), "num_stages": (1, 2),
                            "programs_per_sm": (2, 4), "prefetch": (False, True)}
sys.exit(attention_sweep.main(sys.argv[1:]))
