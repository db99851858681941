"""public_private_split, stratified_split_indices: deterministic, disjoint, complete, stratified."""

import math

import pytest
import torch

from dpclip.data import TensorSplit, public_private_split, stratified_split_indices


def labelled_split(counts):
    """Examples whose single input feature is their index, so identities can be tracked."""
    targets = torch.cat([torch.full((n,), c, dtype=torch.int64) for c, n in enumerate(counts)])
    targets = targets[torch.randperm(len(targets), generator=torch.Generator().manual_seed(0))]
    inputs = torch.arange(len(targets), dtype=torch.float32).unsqueeze(1)
    return TensorSplit(inputs, targets)


def ids(split: TensorSplit) -> list[int]:
    return split.inputs[:, 0].long().tolist()


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.9])
def test_disjoint_complete_and_sized(fraction):
    split = labelled_split([50, 30, 17, 3])
    public, private = public_private_split(split, fraction, seed=0)
    n = len(split)
    assert len(public) == math.floor(fraction * n + 0.5)
    assert len(public) + len(private) == n
    assert set(ids(public)).isdisjoint(ids(private))
    assert sorted(ids(public) + ids(private)) == list(range(n))
    # each example keeps its label
    for part in (public, private):
        assert torch.equal(part.targets, split.targets[part.inputs[:, 0].long()])


def test_stratified():
    split = labelled_split([50, 30, 17, 3])
    public, _ = public_private_split(split, 0.2, seed=1)
    for c, n_c in enumerate([50, 30, 17, 3]):
        assert abs(int((public.targets == c).sum()) - 0.2 * n_c) < 1.0


def test_deterministic_and_seed_dependent():
    split = labelled_split([40, 40, 40])
    a = public_private_split(split, 0.3, seed=5)
    b = public_private_split(split, 0.3, seed=5)
    c = public_private_split(split, 0.3, seed=6)
    assert ids(a[0]) == ids(b[0]) and ids(a[1]) == ids(b[1])
    assert ids(a[0]) != ids(c[0])


def test_keeps_relative_order():
    split = labelled_split([20, 20])
    public, private = public_private_split(split, 0.5, seed=0)
    assert ids(public) == sorted(ids(public)) and ids(private) == sorted(ids(private))


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, math.nan])
def test_fraction_validated(bad):
    with pytest.raises(ValueError, match="public_fraction"):
        public_private_split(labelled_split([10, 10]), bad, seed=0)


def test_fraction_type_validated():
    with pytest.raises(TypeError, match="public_fraction"):
        public_private_split(labelled_split([10, 10]), "0.5", seed=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="TensorSplit"):
        public_private_split((torch.zeros(2, 1), torch.zeros(2)), 0.5, seed=0)  # type: ignore


def test_empty_part_refused():
    with pytest.raises(ValueError, match="empty part"):
        public_private_split(labelled_split([5, 5]), 0.01, seed=0)


def test_indices_function_matches():
    split = labelled_split([30, 10])
    selected, rest = stratified_split_indices(split.targets, 0.25, seed=2)
    public, private = public_private_split(split, 0.25, seed=2)
    assert selected.tolist() == ids(public) and rest.tolist() == ids(private)
    assert selected.dtype == torch.int64


def test_tensor_split_validation():
    with pytest.raises(ValueError, match="float32"):
        TensorSplit(torch.zeros(3, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        TensorSplit(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="number of examples"):
        TensorSplit(torch.zeros(3, 2), torch.zeros(4, dtype=torch.int64))
    split = TensorSplit(torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 0]))
    assert len(split) == 3 and split.input_shape == (2,)
    x, y = split[1]
    assert x.tolist() == [2.0, 3.0] and y.item() == 1


def test_the_trainers_public_split_decides_each_example_on_its_own():
    """Two-hundred-and-sixth hostile review: the stratified split moved 14 OTHER examples between
    the public and private parts when one example left (N = 200); the trainer's split decides
    each example by a keyed hash of its own bytes."""
    from dpclip.data import independent_public_split

    g = torch.Generator().manual_seed(0)
    split = TensorSplit(torch.randn(200, 3, generator=g), torch.randint(0, 3, (200,), generator=g))
    public, private = independent_public_split(split, 0.1, seed=0)
    assert 5 < len(public) < 40 and len(public) + len(private) == 200
    key = {tuple(x.tolist()) for x in public.inputs}
    for drop in range(0, 200, 7):  # (every 7th example removed in turn)
        keep = torch.tensor([i for i in range(200) if i != drop])
        pub2, _ = independent_public_split(split.subset(keep), 0.1, seed=0)
        key2 = {tuple(x.tolist()) for x in pub2.inputs}
        dropped = tuple(split.inputs[drop].tolist())
        assert key2 == key - {dropped}
    again, _ = independent_public_split(split, 0.1, seed=0)
    other, _ = independent_public_split(split, 0.1, seed=1)
    assert torch.equal(again.inputs, public.inputs) and not torch.equal(other.inputs[:5],
                                                                          public.inputs[:5])


def test_the_stratified_split_moves_other_examples():
    """The property the trainer's split exists for: the stratified one lacks it."""
    g = torch.Generator().manual_seed(0)
    split = TensorSplit(torch.randn(200, 3, generator=g), torch.randint(0, 3, (200,), generator=g))
    public, _ = public_private_split(split, 0.1, seed=0)
    key = {tuple(x.tolist()) for x in public.inputs}
    keep = torch.arange(199)
    pub2, _ = public_private_split(split.subset(keep), 0.1, seed=0)
    moved = len({tuple(x.tolist()) for x in pub2.inputs} ^ (key - {tuple(split.inputs[199].tolist())}))
    assert moved > 0
