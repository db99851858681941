"""Hundred-and-thirty-first hostile review: the proved-program match compared a float argument
with ``==`` (NaN with NaN) and a tensor literal with ``torch.equal``, so -0.0 passed for the
proof's 0.0 and -nan for nan; ``copysign`` reads the sign bit. A forward that told the proof from
the real run passed the padded batch size in a zero's sign, flipping every example's output when
one example took the batch across 32 rows: LOO 11.66 C under ghost, auto and compiled (through
``make_private`` too). Now arguments, literals and outside tensors are compared by their bits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.engine import get_engine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import loo_distance

C = 1.0


def _real(t):
    return type(t) is torch.Tensor


def _sign(h, z):
    return torch.copysign(torch.ones(1, h.shape[1], dtype=h.dtype), z)


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def zero(self, h):  # -0.0 in the real run when the padded batch exceeds 32 rows
        z = -0.0 if (_real(h) and h.shape[0] > 32) else 0.0
        return torch.full((1, h.shape[1]), z, dtype=h.dtype)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        sign = _sign(h, self.zero(h))
        return self.fc2(h * sign + 0.5 * sign)


class _Literal(_Scalar):
    def zero(self, h):
        return torch.tensor(-0.0 if (_real(h) and h.shape[0] > 32) else 0.0, dtype=h.dtype)


class _NanSign(_Scalar):
    def zero(self, h):
        nan = float("nan")
        z = -nan if (_real(h) and h.shape[0] > 32) else nan
        return torch.full((1, h.shape[1]), z, dtype=h.dtype)


def _loss(o, y):
    return ((o - y) ** 2).sum(1)


@pytest.mark.parametrize("make", [_Scalar, _Literal, _NanSign], ids=["scalar", "literal", "nan"])
@pytest.mark.parametrize("name", ["ghost", "auto", "compiled"])
def test_a_sign_bit_carrying_the_batch_size_is_refused_or_bounded(make, name):
    torch.manual_seed(1)
    x, y = torch.randn(33, 4), torch.randn(33, 3)  # 33 rows pad to 64, 32 stay 32
    try:
        d = loo_distance(lambda: get_engine(name), make, x, y, C, loss=_loss)
    except UnsupportedModelError:
        return  # refused: sound
    assert d <= 1 + 1e-5, f"{name}: LOO {d:.3f} C"  # (11.657 C before)


# ---------------------------------------------------------------- review 132: a literal's memory

_W = 6
_PLAIN = torch.ones(_W)
_HIDDEN = torch.cat([-torch.ones(_W), torch.ones(_W)])[_W:]  # shows ones; its storage starts -1
_ROWS = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0]] * 2)  # storage: alternating signs
_COLUMNS = _ROWS.t().contiguous().t()  # the same values, column-major: storage in sign pairs


class _HiddenStorage(nn.Module):
    """Hundred-and-thirty-second hostile review: a literal that shows the proof's values over a
    storage holding others (or in another stride order), read through ``as_strided`` with an
    absolute offset: the match compared only the visible bits, LOO 12.4 C (13.4 C by strides)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.fc2 = nn.Linear(4, _W), nn.Linear(_W, 3)

    def literal(self, h):
        return _HIDDEN if (_real(h) and h.shape[0] > 32) else _PLAIN

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        lit = torch.ops.aten.lift_fresh(self.literal(h))
        sign = torch.as_strided(lit, (1, _W), (0, 1), 0)  # (storage order, from offset 0)
        return self.fc2(h * sign + 0.5 * sign)


class _OtherStrides(_HiddenStorage):
    def literal(self, h):
        return _COLUMNS if (_real(h) and h.shape[0] > 32) else _ROWS


@pytest.mark.parametrize("make", [_HiddenStorage, _OtherStrides], ids=["offset", "strides"])
@pytest.mark.parametrize("name", ["ghost", "auto", "compiled"])
def test_a_literal_is_matched_by_its_memory_not_only_its_values(make, name):
    torch.manual_seed(1)
    x, y = torch.randn(33, 4), torch.randn(33, 3)
    try:
        d = loo_distance(lambda: get_engine(name), make, x, y, C, loss=_loss)
    except UnsupportedModelError:
        return  # refused: sound
    assert d <= 1 + 1e-5, f"{name}: LOO {d:.3f} C"  # (12.41 / 13.38 C before)
