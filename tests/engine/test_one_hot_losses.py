"""Losses built on ``F.one_hot`` (a false refusal of the forty-ninth review's list).

On real tensors ``one_hot`` checks its labels in Python and scatters; on the batch-size proof's
fake tensors it computes ``eq(y.unsqueeze(-1), arange(k))``: the step's program differed from the
proof's and every such loss was refused ("operation 2 is aminmax, the proof ran arange there").
Inside the trace dpclip now runs the proof's form, and checks the labels as ``one_hot`` does.
Oracle: the float64 per-example loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from tests.engine.helpers import DT, assert_equal_to_the_loop, clip_weights

B, K = 6, 4


def _data(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 5, generator=g, dtype=DT), torch.randint(0, K, (B,), generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, K)).to(DT)


def one_hot_ce(o: Tensor, y: Tensor) -> Tensor:
    return -(F.one_hot(y, K).to(o.dtype) * o.log_softmax(1)).sum(1)


def smoothed_ce(o: Tensor, y: Tensor) -> Tensor:
    t = F.one_hot(y, num_classes=K).to(o.dtype) * 0.9 + 0.1 / K
    return -(t * F.log_softmax(o, -1)).sum(-1)


def one_hot_mse(o: Tensor, y: Tensor) -> Tensor:
    return ((o.softmax(1) - torch.nn.functional.one_hot(y, K)) ** 2).sum(1)


@pytest.mark.parametrize("loss", [one_hot_ce, smoothed_ce, one_hot_mse])
def test_one_hot_losses_run_on_ghost_equal_to_the_loop(loss):
    x, y = _data()
    model = _model()
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        for engine in (GhostEngine(), AutoEngine(), GhostEngine(max_physical_batch=4)):
            res = engine.compute(model, loss, x, y, clip_weights(0.2), groups)
            assert_equal_to_the_loop(res, model, loss, x, y, groups)


def test_one_hot_of_mixed_labels_stays_refused():
    def rolled(o: Tensor, y: Tensor) -> Tensor:
        return -(F.one_hot(y.roll(1, 0), K).to(o.dtype) * o.log_softmax(1)).sum(1)

    x, y = _data()
    model = _model()
    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, rolled, x, y, clip_weights(0.2), ParamGroups.flat(model))


def test_one_hot_without_num_classes_is_not_proven():
    def inferred(o: Tensor, y: Tensor) -> Tensor:
        return -(F.one_hot(y).to(o.dtype) * o.log_softmax(1)[:, :1]).sum(1)

    x, y = _data()
    y[:] = 0  # one class: the inferred count is 1, which the shapes need
    model = _model()
    with pytest.raises(UnsupportedModelError, match="num_classes|Python"):
        GhostEngine().compute(model, inferred, x, y, clip_weights(0.2), ParamGroups.flat(model))


def test_a_label_out_of_range_raises_and_catching_it_voids_the_proof():
    x, y = _data()
    y[2] = K  # out of range
    model = _model()
    with pytest.raises(Exception, match="num_classes|class values"):
        GhostEngine().compute(model, one_hot_ce, x, y, clip_weights(0.2),
                              ParamGroups.flat(model))

    def caught(o: Tensor, y: Tensor) -> Tensor:
        try:
            t = F.one_hot(y, K).to(o.dtype)
        except RuntimeError:  # a bit of example data in Python
            t = torch.zeros(y.shape[0], K, dtype=o.dtype)
        return -(t * o.log_softmax(1)).sum(1)

    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, caught, x, y, clip_weights(0.2), ParamGroups.flat(model))


def test_num_classes_as_a_numpy_integer():
    import numpy as np

    def loss(o: Tensor, y: Tensor) -> Tensor:
        return -(F.one_hot(y, np.int64(K)).to(o.dtype) * o.log_softmax(1)).sum(1)

    x, y = _data()
    model = _model()
    groups = ParamGroups.flat(model)
    res = AutoEngine().compute(model, loss, x, y, clip_weights(0.2), groups)
    assert_equal_to_the_loop(res, model, loss, x, y, groups)


_SIGN = [1.0]


def test_one_hot_of_uninitialised_memory_voids_the_proof():
    """Fifty-third hostile review: the label check runs below the trace, so one_hot of a
    ``torch.empty`` tensor (public size, unused result) read freed memory unseen, and a caught
    error set a Python flag in a step ghost accepted. Reading unwritten memory voids the proof,
    and so does any error of the check that the model catches, whatever the labels' layout."""

    def loss(o: Tensor, y: Tensor) -> Tensor:
        u = torch.empty(4096, dtype=torch.long)
        try:
            F.one_hot(u, 1)
        except RuntimeError:
            _SIGN[0] = -1.0
        return -(F.one_hot(y, K).to(o.dtype) * o.log_softmax(1)).sum(1) * _SIGN[0] ** 2

    x, y = _data()
    model = _model()
    with pytest.raises(UnsupportedModelError, match="torch.empty|one_hot"):
        GhostEngine().compute(model, loss, x, y, clip_weights(0.2), ParamGroups.flat(model))

    def caught_constant(o: Tensor, y: Tensor) -> Tensor:
        try:
            F.one_hot(torch.full((3,), 7), 2)  # a constant out of range
        except RuntimeError:
            pass
        return one_hot_ce(o, y)

    with pytest.raises(UnsupportedModelError, match="one_hot"):
        GhostEngine().compute(model, caught_constant, x, y, clip_weights(0.2),
                              ParamGroups.flat(model))
