"""Issue 5: the tree-attention sweep (treeserve.verifier.attention_sweep) over smaller query-row blocks and more
programs per multiprocessor than its defaults, on the shapes of issue 5's ratio (1 and 65 rows at 1k context)
and two more. From the repository root on the H200:
python3 docs/logs/2026-12-01-h200-attention-small-blocks.py --out attention-small-blocks.json"""
import sys
from treeserve.verifier import attention_sweep

attention_sweep.SETTINGS = {"query_rows": (16, 32, 64, 128), "block_n": (32, 64), "num_warps": (4,),
                            "num_stages": (1, 2), "programs_per_sm": (1, 2, 4, 8)}
sys.exit(attention_sweep.main(["--shapes", "1x1x1024,1x65x1024,1x129x1024,1x65x8192", *sys.argv[1:]]))
