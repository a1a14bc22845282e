"""Our GGUF header reader agrees with gguf.GGUFReader (the library's own, slower parser) on every field and
every tensor, quantized or not."""

import gguf
import numpy as np
import pytest

import tiny_models
from treeserve.errors import TreeserveError
from treeserve.loading.gguf_file import GGUFFile


@pytest.mark.parametrize("qtype", [None, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1],
                         ids=["f32", "q8_0", "q4_1"])
def test_header_matches_the_gguf_library(tmp_path, qtype):
    path = tiny_models.write_gguf("llama3", tmp_path / "m.gguf", seed=0, qtype=qtype)
    ours = GGUFFile(path)
    reference = gguf.GGUFReader(str(path))
    for key, field in reference.fields.items():
        if not key.startswith("GGUF."):  # the reader's own pseudo-fields for the header counts
            assert ours.metadata[key] == field.contents(), key
    assert set(ours.tensors) == {t.name for t in reference.tensors}
    for tensor in reference.tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(ours.tensor(tensor.name).numpy().ravel(), expected.ravel(), tensor.name)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(TreeserveError, match="no GGUF magic"):
        GGUFFile(path)
