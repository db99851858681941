"""``batch_chunks``: the one chunk loop of the engines (vmap, naive, summed, ghost)."""

from __future__ import annotations

import pytest
import torch

from dpclip.engine._common import batch_chunks


@pytest.mark.parametrize("size", [None, 1, 3, 7, 10, 64])
def test_chunks_cover_the_batch_in_order(size):
    x = torch.arange(20.0).reshape(10, 2)
    y = {"a": torch.arange(10), "b": (torch.arange(10) * 2,)}
    chunks = list(batch_chunks(x, y, 10, size))
    assert sum(rows for rows, _, _ in chunks) == 10
    assert all(rows <= (size or 10) for rows, _, _ in chunks)
    assert torch.equal(torch.cat([xs for _, xs, _ in chunks]), x)
    assert torch.equal(torch.cat([ys["b"][0] for _, _, ys in chunks]), y["b"][0])
    assert all(xs.shape[0] == rows == ys["a"].shape[0] for rows, xs, ys in chunks)


def test_one_chunk_is_an_owned_copy_of_the_batch_and_an_empty_batch_no_chunk():
    """Every chunk, one holding the whole batch too, is a copy in storage of its own: the model
    never holds the caller's tensors (hundred-and-thirtieth hostile review)."""
    x, y = torch.randn(5, 3), torch.arange(5)
    ((rows, xs, ys),) = batch_chunks(x, y, 5, 8)
    assert rows == 5 and torch.equal(xs, x) and torch.equal(ys, y)
    assert xs.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert ys.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    for _, xs, _ in batch_chunks(x, y, 5, 2):  # (slices too: not views of the caller's storage)
        assert xs.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert list(batch_chunks(x[:0], y[:0], 0, 8)) == []
    assert list(batch_chunks(x[:0], y[:0], 0, None)) == []
