"""Hundred-and-third hostile review (of the unit guard after review 101): eight more ways one
unit's value reached the next unit or call, each 4.000 C against the declared 2 C through
``unit_sum`` (2.000 C into a BC call that did not draw the example; 3.894 C through
``make_private(unit="gbc")`` for six of them): batch norm's written-only exemption given a global
as ``running_mean`` (``native_batch_norm`` writes it without a schema annotation);
``torch.from_file(shared=True)`` taken for memory the unit made; a sparse tensor's ``_values()``
view taken for fresh memory; ``slice_inverse(G, t)`` making a global look like the unit's; a
``weakref.finalize`` on the unit's copy of its examples, run after the guard's modes ended; and
value-dependent output shapes read with ``.shape`` (``to_sparse``, ``bincount(out=)``,
``pack_padded_sequence``).

Now batch norm may write only into the model's own buffers (or the unit's memory), ``from_file``
is refused in a unit, only outputs that alias no argument count as made in the unit, a view of
memory that is not the unit's made from the unit's values is refused, every tensor of the unit is
zeroed when the unit ends (its result copied first), and an operation on the unit's values must
give the output shapes its meta kernel gives from the input shapes alone."""

from __future__ import annotations

import os
import tempfile
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import ParamGroups
from dpclip.engine.unit_guard import UnitDataRefused
from dpclip.training.units import unit_sum
from tests.core.test_review101_units import _batches, _dist, _loss, _wf

C = 1.0




class BNGlobal:
    """A training-mode batch_norm whose running mean is a GLOBAL tensor (not a model buffer):
    the exemption lets the unit write its mean there; a NumPy view taken before reads it back."""
    def __init__(self):
        self.m = torch.zeros(1); self.v = torch.ones(1)
        self.n = self.m.numpy()
    def get(self):
        return float(self.n[0]) or None
    def put(self, t):
        F.batch_norm(t.reshape(1, 1).expand(2, 1), self.m, self.v, training=True, momentum=1.0)
        self.n_ = None


class FromFile:
    """torch.from_file(shared=True) in the unit: made by the dispatcher from no tensor (born), so
    the unit may write into it; its memory is a file another mapping (or open()) reads back."""
    def __init__(self):
        fd, self.path = tempfile.mkstemp(); os.close(fd)
        with open(self.path, "wb") as f:
            f.write(b"\0" * 4)
    def get(self):
        return float(np.fromfile(self.path, dtype=np.float32)[0]) or None
    def put(self, t):
        f = torch.from_file(self.path, shared=True, size=1, dtype=torch.float32)
        f.copy_(t.reshape(1))


class SparseValues:
    """A global sparse tensor's _values(): the sparse tensor has no storage, so the view's
    storage is not among the inputs' and comes out 'born'; a NumPy view taken before reads it
    (one sparse tensor per unit: the one written is tagged afterwards)."""
    def __init__(self):
        self.s = [torch.sparse_coo_tensor(torch.tensor([[0]]), torch.zeros(1), (4,)).coalesce()
                  for _ in range(8)]
        self.n = [s._values().numpy() for s in self.s]
        self.i = 0
    def get(self):
        return float(self.n[self.i - 1][0]) if self.i else None
    def put(self, t):
        self.s[self.i]._values().copy_(t.reshape(1))
        self.i += 1


class SliceInverse:
    """aten.slice_inverse(G, t) takes the unit's tensor and returns a view of the global G: G's
    storage is tagged with the unit (an output of a unit's operation), after which the unit may
    write into G; a NumPy view of G taken before reads it back."""
    def __init__(self):
        self.g = [torch.zeros(1) for _ in range(8)]
        self.n = [g.numpy() for g in self.g]
        self.i = 0
    def get(self):
        return float(self.n[self.i - 1][0]) if self.i else None
    def put(self, t):
        g = self.g[self.i]
        torch.ops.aten.slice_inverse(g, t.reshape(1), 0, 0, 1, 1)
        g.copy_(t.reshape(1))
        self.i += 1


class MakeDual:
    """aten._make_dual(G, tangent) takes the unit's tensor and returns a view of the global G:
    the output (G's storage) is tagged with the unit, after which writing into G is allowed."""
    def __init__(self):
        self.g = torch.zeros(1)
        self.n = self.g.numpy()
    def get(self):
        return float(self.n[0]) or None
    def put(self, t):
        import torch.autograd.forward_ad as fwAD
        with fwAD.dual_level():
            fwAD.make_dual(self.g, t.reshape(1).detach())
        self.g.copy_(t.reshape(1))


class Finalizer:
    """weakref.finalize on the unit's input x: it dies when UnitGuard.run returns, after the
    guard's modes are off, and the callback reads the unit's tagged tensor into Python."""
    def __init__(self):
        self.val = [None]
    def get(self):
        return self.val[0]
    def put(self, t):
        pass
    def hook_x(self, x, t):
        def cb(b, box):
            box[0] = float(b.numpy()[0])
        b = t.reshape(1).clone()
        weakref.finalize(x, cb, b, self.val)


class SparseNnz:
    """x.to_sparse(): its number of stored values (the shape of _values(), read in Python with no
    operation) is the count of nonzero entries of a unit tensor: a Python int the next unit reads."""
    def __init__(self):
        self.val = [None]
    def get(self):
        return self.val[0]
    def put(self, t):
        bit = torch.relu(t.reshape(1))  # 1 if the unit's sum > 0, else 0
        self.val[0] = 2.0 * bit.to_sparse()._values().shape[0] - 1.0


class BincountOut:
    """aten.bincount.out into a tensor the forward made: resized to max + 1 inside the kernel."""
    def __init__(self):
        self.val = [None]
    def get(self):
        return self.val[0]
    def put(self, t):
        o = torch.zeros(0, dtype=torch.long)
        torch.ops.aten.bincount.out((torch.relu(t.reshape(1)) * 3).long(), None, 0, out=o)
        self.val[0] = 1.0 if o.shape[0] > 1 else -1.0


class PackPadded:
    """pack_padded_sequence with lengths computed from the unit: batch_sizes' shape (Python)."""
    def __init__(self):
        self.val = [None]
    def get(self):
        return self.val[0]
    def put(self, t):
        lengths = (torch.relu(t.reshape(1)) + 1).long()  # 2 if > 0 else 1
        p = nn.utils.rnn.pack_padded_sequence(torch.zeros(1, 2, 1), lengths, batch_first=True)
        self.val[0] = 1.0 if p.data.shape[0] > 1 else -1.0


CHANNELS = {"bn-global": BNGlobal, "from-file": FromFile, "sparse-values": SparseValues,
            "slice-inverse": SliceInverse, "make-dual": MakeDual, "finalizer": Finalizer,
            "sparse-nnz": SparseNnz, "bincount-out": BincountOut, "pack-padded": PackPadded}


def _model(chan):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2, bias=False)

        def forward(self, x):
            s = chan.get()
            out = self.fc(x) * (1.0 if s is None else s)
            sig = torch.sign(x[:, 0].sum()).detach()
            chan.put(sig)
            if hasattr(chan, "hook_x"):
                chan.hook_x(x, sig)
            return out
    torch.manual_seed(0)
    return M()


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_gbc_the_next_unit_does_not_see_the_example(channel):
    x, xp, y = _batches()
    got = []
    try:
        for xx in (x, xp):
            m = _model(CHANNELS[channel]())
            got.append(unit_sum(m, _loss, xx, y, _wf, ParamGroups.flat(m)))
    except UnitDataRefused as exc:
        assert "unit clipping" in str(exc)
        return
    assert _dist(*got) <= 2 * C * (1 + 1e-6)  # (4.0 C before)


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_bc_a_call_without_the_example_does_not_see_it(channel):
    x, xp, y = _batches()
    got = []
    try:
        for first in (x, xp):
            m = _model(CHANNELS[channel]())
            unit_sum(m, _loss, first[:1].reshape(1, 2, 4), y[:1], _wf, ParamGroups.flat(m))
            got.append(unit_sum(m, _loss, x[1:].reshape(1, 2, 4), y[1:], _wf,
                                ParamGroups.flat(m)))
    except UnitDataRefused as exc:
        assert "unit clipping" in str(exc)
        return
    assert _dist(*got) <= 1e-6  # (2.0 C before)


def test_batch_norm_still_trains_on_its_own_buffers():
    """The model's own BatchNorm in training mode: accepted, its buffers put back."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    before = m[1].running_mean.clone()
    x = torch.randn(2, 4, 4)
    got = unit_sum(m, _loss, x, torch.zeros(2, 4), _wf, ParamGroups.flat(m))
    assert all(torch.isfinite(g).all() for g in got.grads.values())
    assert torch.equal(m[1].running_mean, before)


class _Seq(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.e = nn.Embedding(20, 16)
        if kind == "encoder":
            self.body = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.1)
        else:
            self.body = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](
                16, 16, batch_first=True, num_layers=2)
        self.o = nn.Linear(16, 3)

    def forward(self, x):
        h = self.body(self.e(x))
        h = h[0][:, -1] if isinstance(h, tuple) else h.mean(1)
        return self.o(h)


class _ConvNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.o = nn.Linear(4, 3)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.gn(self.bn(self.c(x)))), 2)
        return self.o(F.adaptive_avg_pool2d(h, 1).flatten(1))


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn", "encoder", "conv"])
def test_ordinary_models_run_in_units(kind):
    """The output-shape check and the write rule refuse none of torch's ordinary layers (oneDNN's
    LSTM layer, whose meta kernel sizes its workspace otherwise, included)."""
    torch.manual_seed(0)
    if kind == "conv":
        m, x = _ConvNorms(), torch.randn(3, 4, 1, 10, 10)
    else:
        m, x = _Seq(kind), torch.randint(0, 20, (3, 4, 6))
    y = torch.randint(0, 3, (3, 4))
    got = unit_sum(m, lambda o, t: F.cross_entropy(o, t, reduction="none"), x, y, _wf,
                   ParamGroups.flat(m))
    assert got.norms.shape == (3,) and torch.isfinite(got.norms).all()


class _ReadsItsBN(nn.Module):
    """Hundred-and-fifth review: the model's own BatchNorm in training mode (the ordinary call)
    writes the unit's batch mean into ``running_mean``; the next unit's forward reads that buffer
    as a tensor (no Python read): 4.0 C against 2 C through ``unit_sum``, 3.894 C through
    ``make_private(unit="gbc")``. Now the statistics are the unit's (a later unit's read is
    refused, or finds them put back: they are restored after every unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2, bias=False)
        self.bn = nn.BatchNorm1d(1)

    def forward(self, x):
        rm = self.bn.running_mean[0] * 10.0  # 0 at the first unit, else the carried sign
        s = rm + (rm == 0).float()
        out = self.fc(x) * s
        self.bn(torch.sign(x[:, 0].sum()).detach().reshape(1, 1).expand(2, 1))
        return out


def test_a_unit_does_not_read_the_previous_unit_s_batch_statistics():
    x, xp, y = _batches()
    got = []
    try:
        for xx in (x, xp):
            torch.manual_seed(0)
            m = _ReadsItsBN()
            got.append(unit_sum(m, _loss, xx, y, _wf, ParamGroups.flat(m)))
    except UnitDataRefused as exc:
        assert "unit clipping" in str(exc)
        return
    assert _dist(*got) <= 2 * C * (1 + 1e-6)  # (4.0 C before)


_CARRY: list = [None]


class _BNNumpyView(nn.Module):
    """Hundred-and-seventh review: the model's own BatchNorm buffer shared with a NumPy view taken
    in ``__init__``; read in Python right after the training-mode batch norm wrote the unit's
    batch mean into it (inside the unit): 4.0 C against 2 C (GBC), 2.0 C into a BC call without
    the example. Now a unit's batch norm writes its statistics into copies."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2, bias=False)
        self.bn = nn.BatchNorm1d(1, momentum=1.0)
        self.stats_np = self.bn.running_mean.numpy()

    def forward(self, x):
        s = _CARRY[0]
        out = self.fc(x) * (1.0 if s is None else s)
        self.bn(torch.sign(x[:, 0].sum()).detach().reshape(1, 1).expand(2, 1))
        _CARRY[0] = float(self.stats_np[0]) or None
        return out


def test_a_numpy_view_of_the_model_s_batch_norm_buffer_sees_nothing():
    x, xp, y = _batches()
    got, nxt = [], []
    try:
        for xx in (x, xp):
            _CARRY[0] = None
            torch.manual_seed(0)
            m = _BNNumpyView()
            got.append(unit_sum(m, _loss, xx, y, _wf, ParamGroups.flat(m)))
            nxt.append(unit_sum(m, _loss, x[1:], y[1:], _wf, ParamGroups.flat(m)))
    except UnitDataRefused as exc:
        assert "unit clipping" in str(exc)
        return
    finally:
        _CARRY[0] = None
    assert _dist(*got) <= 2 * C * (1 + 1e-6)  # (4.0 C before)
    assert _dist(*nxt) <= 1e-6  # (2.0 C before)


class _DrawCount(nn.Module):
    """Hundred-and-ninth review: ``torch.poisson`` of a rate computed from the unit (0 draws
    nothing, 1 draws) moved the default generator by a data-dependent count; the state compared
    with ``torch.get_rng_state()`` carried that bit to the next unit: 4.0 C (GBC), 2.0 C into BC
    calls without the example, 3.894 C through make_private. Now a random operation on the
    unit's values reseeds the unit's generators."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2, bias=False)

    def forward(self, x):
        s = _CARRY[0]
        out = self.fc(x) * (1.0 if s is None else s)
        bit = torch.relu(torch.sign(x[:, 0].sum())).detach()
        s0 = torch.get_rng_state()
        torch.poisson(bit.reshape(1))
        _CARRY[0] = -1.0 if torch.equal(s0, torch.get_rng_state()) else 1.0
        return out


def test_a_random_draw_count_carries_nothing_to_the_next_unit():
    x, xp, y = _batches()
    got, nxt = [], []
    try:
        for xx in (x, xp):
            _CARRY[0] = None
            torch.manual_seed(0)
            m = _DrawCount()
            got.append(unit_sum(m, _loss, xx, y, _wf, ParamGroups.flat(m)))
            nxt.append(unit_sum(m, _loss, x[1:], y[1:], _wf, ParamGroups.flat(m)))
    except UnitDataRefused as exc:
        assert "unit clipping" in str(exc)
        return
    finally:
        _CARRY[0] = None
    assert _dist(*got) <= 2 * C * (1 + 1e-6)  # (4.0 C before)
    assert _dist(*nxt) <= 1e-6  # (2.0 C before)
