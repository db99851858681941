"""The state guard (dpclip.engine.state_guard, through dpclip.training.step.private_buffer_guard): every way
we know of to write private data into model state during a step, without or with a version-counter
change, is refused and undone; unchanged state (NaN included) passes."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.training.step import PrivateBufferError, private_buffer_guard


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("stat", torch.zeros(4))
        self.frozen = nn.Parameter(torch.zeros(4), requires_grad=False)


def _write_data(m: Base, x: Tensor) -> None:  # .data has its own version counter
    m.stat.data.copy_(x.mean(0))


def _write_numpy(m: Base, x: Tensor) -> None:  # NumPy shares memory, no counter
    m.stat.numpy()[:] = x.detach().numpy().mean(0)


def _write_storage(m: Base, x: Tensor) -> None:  # raw storage: no counter
    src = x.detach().mean(0).contiguous()
    m.stat.untyped_storage().copy_(src.untyped_storage())


def _write_dlpack(m: Base, x: Tensor) -> None:  # a DLPack alias has its own counter
    torch.utils.dlpack.from_dlpack(m.stat.__dlpack__()).copy_(x.mean(0))


def _write_reset_counter(m: Base, x: Tensor) -> None:  # the counter written back by hand
    v = m.stat._version
    with torch.no_grad():
        m.stat.copy_(x.mean(0))
    torch._C._autograd._unsafe_set_version_counter((m.stat,), (v,))


def _write_set_data(m: Base, x: Tensor) -> None:  # the tensor keeps its identity and counter
    m.stat.data = x.detach().mean(0).clone()


def _write_frozen_numpy(m: Base, x: Tensor) -> None:
    m.frozen.detach().numpy()[:] = x.detach().numpy().mean(0)


def _new_buffer(m: Base, x: Tensor) -> None:
    m.register_buffer("extra", x.detach().mean(0))


def _new_parameter(m: Base, x: Tensor) -> None:
    m.extra = nn.Parameter(x.detach().mean(0), requires_grad=False)


def _new_submodule(m: Base, x: Tensor) -> None:
    m.extra = nn.Linear(4, 1)
    m.extra.weight.data = x.detach().mean(0, keepdim=True)


def _replaced_buffer_none(m: Base, x: Tensor) -> None:
    m.stat = None


WRITES = {"data": _write_data, "numpy": _write_numpy, "storage": _write_storage,
          "dlpack": _write_dlpack, "reset-counter": _write_reset_counter,
          "set-data": _write_set_data, "frozen-numpy": _write_frozen_numpy,
          "new-buffer": _new_buffer, "new-parameter": _new_parameter,
          "new-submodule": _new_submodule, "buffer-to-none": _replaced_buffer_none}


@pytest.mark.parametrize("how", list(WRITES))
def test_every_write_of_private_data_into_state_is_refused_and_undone(how):
    """The buffer guard of 0.2 compared version counters: the .data, NumPy, storage, DLPack,
    counter-reset and set-data writes into a buffer passed it, and a buffer, parameter or submodule
    added during the step passed unseen (each case failed before this guard)."""
    torch.manual_seed(0)
    m = Base()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    objs = {k: v for k, v in list(m.named_parameters()) + list(m.named_buffers())}
    x = torch.randn(8, 4) + 3.0
    with pytest.raises(PrivateBufferError):
        with private_buffer_guard(m):
            WRITES[how](m, x)
    after = m.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k
    now = {k: v for k, v in list(m.named_parameters()) + list(m.named_buffers())}
    assert now.keys() == objs.keys() and all(now[k] is objs[k] for k in objs)
    assert not hasattr(m, "extra")


def test_the_error_names_the_buffer_and_the_fix():
    m = Base()
    with pytest.raises(PrivateBufferError, match="'stat'.*track_running_stats=False"):
        with private_buffer_guard(m):
            _write_data(m, torch.randn(8, 4))


def test_unchanged_state_passes_nan_and_tied_parameters_included():
    m = Base()
    with torch.no_grad():
        m.stat.fill_(float("nan"))
    m.tied = m.lin  # the same module twice
    m.register_buffer("i", torch.arange(3))
    m.flag = torch.tensor(True)  # a tensor attribute read, not written
    with private_buffer_guard(m):
        m.lin(torch.randn(2, 4))
        _ = m.flag & m.i.bool().all()


def test_an_in_place_write_restored_in_the_block_passes():
    """As units.frozen_bn_buffers does under batch clipping."""
    m = Base()
    with private_buffer_guard(m):
        saved = m.stat.clone()
        with torch.no_grad():
            m.stat.add_(1.0)
            m.stat.copy_(saved)


def test_a_non_contiguous_or_int_state_tensor_is_compared_too():
    m = Base()
    m.register_buffer("t", torch.randn(4, 3).t())  # not contiguous: compared by value
    m.register_buffer("n", torch.zeros(3, dtype=torch.int64))
    for write in (lambda: m.t.data.add_(1.0), lambda: m.n.data.add_(1)):
        with pytest.raises(PrivateBufferError):
            with private_buffer_guard(m):
                write()
    assert torch.equal(m.n, torch.zeros(3, dtype=torch.int64))


def test_a_large_state_is_compared_tensor_by_tensor(monkeypatch):
    """Above the one-copy size the comparison runs per tensor (no second full copy): the same
    verdicts."""
    import dpclip.engine.state_guard as sg

    monkeypatch.setattr(sg, "_ONE_COPY_BYTES", 0)
    m = Base()
    with private_buffer_guard(m):
        m.lin(torch.randn(2, 4))
    with pytest.raises(PrivateBufferError, match="'frozen'"):
        with private_buffer_guard(m):
            _write_frozen_numpy(m, torch.randn(8, 4))
    assert torch.equal(m.frozen, torch.zeros(4))
