"""The proof's ``torch.matmul`` (``batch_symbol._matmul_as_eager``) emits the eager C++ kernel's
operations, and keeps the batch symbolic.

The GPU machines' torch 2.11 read a 3-D or larger matmul operand's sizes as plain integers in its
C++ kernel, so the proof of every model with a batched matmul (every eager attention) failed with
"Constraints violated (batch)" (benchmarks/results/hf_models_cuda.md: BERT, GPT-2, Llama and ViT
refused, auto on vmap at 13-41x non-private). The proof now runs its own symbolic matmul, which must
emit exactly the eager kernel's operations, or the real run would not match the proof
(dpclip.engine.proved_program) and every step would be refused.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dpclip.engine import GhostEngine, ParamGroups
from dpclip.engine.batch_symbol import _eager_kernels, _matmul_as_eager, batch_size_uses
from tests.engine.helpers import assert_equal_to_the_loop, clip_weights


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(f"{func}{[tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]}")
        return out


def _run(fn, a, b):
    with _Ops() as rec:
        out = fn(a, b)
    return rec.ops, out


SHAPES = [((2, 3), (5, 3, 4)), ((3,), (5, 3, 4)), ((5, 2, 3), (3, 4)), ((5, 2, 3), (3,)),
          ((5, 2, 3), (5, 3, 4)), ((5, 2, 3), (1, 3, 4)), ((1, 2, 3), (5, 3, 4)),
          ((6, 5, 2, 3), (6, 5, 3, 4)), ((6, 5, 2, 3), (5, 3, 4)), ((6, 5, 2, 3), (3, 4)),
          ((6, 1, 2, 3), (1, 5, 3, 4)), ((6, 5, 2, 3), (3,)), ((4, 3), (6, 5, 3, 2)),
          ((3,), (6, 5, 3, 2)), ((6, 5, 2, 3), (6, 5, 3, 1)), ((5, 2, 3), (6, 5, 3, 4)),
          ((2, 3), (5, 3, 1)), ((5, 1, 3), (3,)), ((0, 2, 3), (3, 4)), ((2, 3), (3, 4)),
          ((3,), (3,))]


@pytest.mark.parametrize("s1,s2", SHAPES)
def test_the_same_operations_as_the_eager_kernel(s1, s2):
    """Every combination of requires_grad and of a transposed (non-contiguous) operand: the
    fold test depends on both."""
    for g1, g2, t1, t2 in itertools.product((False, True), repeat=4):
        a, b = torch.randn(*s1), torch.randn(*s2)
        if t1 and a.dim() >= 2:
            a = a.mT.contiguous().mT
        if t2 and b.dim() >= 2:
            b = b.mT.contiguous().mT
        a.requires_grad_(g1)
        b.requires_grad_(g2)
        eager, want = _run(torch.matmul, a, b)
        ours, got = _run(_matmul_as_eager, a, b)
        assert ours == eager, (s1, s2, g1, g2, t1, t2)
        assert torch.equal(got, want) and got.stride() == want.stride()


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 3)

    def forward(self, x):  # (B, T, 8): eager attention, two heads
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        w = torch.matmul(q, k.transpose(-1, -2)).softmax(-1)
        return self.out(torch.matmul(w, v).transpose(1, 2).reshape(b, t, 8)).mean(1)


def test_an_eager_attention_is_proved_and_runs_on_ghost():
    """Proved with a symbolic batch (on torch 2.11 the C++ kernel specialised it) and the real
    run matches the proof: ghost's gradient equals the float64 per-example loop."""
    torch.manual_seed(0)
    model = _Attention().double()
    x, y = torch.randn(6, 5, 8, dtype=torch.float64), torch.randint(0, 3, (6,))
    loss = nn.CrossEntropyLoss(reduction="none")
    assert batch_size_uses(model, loss, x, y) is None
    groups = ParamGroups.flat(model)
    res = GhostEngine().compute(model, loss, x, y, clip_weights(1.0), groups)
    assert_equal_to_the_loop(res, model, loss, x, y, groups)


def test_mixing_through_a_batched_matmul_is_still_refused():
    """The batch contracted by a matmul (examples attend to each other) is refused."""
    class Across(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):  # (B, 2, 4): a (2, B, B) attention across the batch
            h = x.transpose(0, 1)
            w = torch.matmul(h, h.transpose(-1, -2)).softmax(-1)
            return self.fc(torch.matmul(w, h).transpose(0, 1)).mean(1)

    x, y = torch.randn(6, 2, 4), torch.randint(0, 3, (6,))
    assert batch_size_uses(Across(), nn.CrossEntropyLoss(reduction="none"), x, y) is not None


def test_the_kernel_is_put_back():
    mm = torch.ops.aten.matmul.default
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    before = mm.py_kernels.get(key)
    with _eager_kernels():
        assert mm.py_kernels[key] is _matmul_as_eager
    assert mm.py_kernels.get(key) is before
