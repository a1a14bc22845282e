"""Rows: a request's rows of a forward's shared outputs, gathered into one tensor per round."""

import pytest
import torch

from treeserve.verifier.rows import Rows, gather


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_gather_joins_parts_in_order_whatever_their_index(device):
    source = torch.arange(40.0, device=device).view(10, 4)
    other = torch.arange(100.0, 108.0, device=device).view(2, 4)
    parts = [Rows(source, range(0, 3)), Rows(source, range(5, 6)), Rows(source, [9, 7]), Rows(source, range(4, 4)),
             Rows(other, range(1, 2)), Rows(source, range(2, 4))]
    want = torch.cat([source[0:3], source[5:6], source[[9, 7]], other[1:2], source[2:4]])
    assert torch.equal(gather(parts), want)
    assert torch.equal(gather(parts, copy=True), want)


def test_one_run_is_a_view_unless_copied():
    source = torch.arange(12.0).view(6, 2)
    plain_round = [Rows(source, range(b, b + 1)) for b in range(4)]  # one row per request, one after another
    view = gather(plain_round)
    assert view.data_ptr() == source.data_ptr() and torch.equal(view, source[:4])
    copied = gather(plain_round, copy=True)
    source.zero_()  # a CUDA graph's next replay overwrites its outputs
    assert copied.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]


def test_slices_and_select_name_rows_of_the_part():
    source = torch.arange(20.0).view(10, 2)
    part = Rows(source, range(4, 9))
    assert len(part) == 5 and len(part[:2]) == 2
    assert torch.equal(part[:2].tensor(), source[4:6])
    # A slice of a range stays a range: gathered as a view, with no index to copy to the device (a prompt's last
    # row, each piece of a prefill: a copy from pageable memory would wait for the piece's forward).
    assert isinstance(part[-1:].index, range) and part[-1:].tensor().data_ptr() == source[8].data_ptr()
    assert torch.equal(part.select([0, 3, 4]).tensor(), source[[4, 7, 8]])
    assert torch.equal(part.select([0, 3]).select([1]).tensor(), source[[7]])
    assert torch.equal(Rows(source).tensor(), source)


def test_gather_needs_a_part():
    with pytest.raises(ValueError):
        gather([])
