"""Twenty-fourth hostile review (of b088b9d), each failing there:

1. The engine held a chunk's tensors until its rules had read them, then released them before the
   next chunk: a ``weakref.finalize`` on a per-layer module's output, run at that release, wrote a
   parameter-free module's buffer from the chunk's data (1000 when the chunk holds an outlier),
   which the next chunk's forward took for a public constant (LOO 1.93 C in chunks of 4, 2.17 C in
   chunks of 1, under ghost and auto). Now a chunk's tensors are released once the next chunk's
   memory watch has its copies: the finalizer's write is a change of watched memory, refused.
2. A per-layer module returning ``o.detach().requires_grad_()`` (a leaf made in the call): the
   replay differentiated through the recorded detach and gave the module's parameter a gradient it
   does not have (wrong gradients, bounded). Now such an output gives the replay no gradient.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from tests.engine.helpers import (DT, Scale, assert_equal_to_the_loop, ce, clip_weights, is_real,
                                  loo_distance, outlier_batch)

C = 0.5


def _write(buf: Tensor, d: Tensor) -> None:
    if is_real(d):
        with torch.no_grad():
            buf.copy_(torch.where(d.abs().amax() > 20, 1000.0, buf))


class _Mul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.ones(4, dtype=DT))

    def forward(self, h: Tensor) -> Tensor:
        return h * self.s


class _CarriesBetweenChunks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc0, self.p, self.fc1 = nn.Linear(5, 4).to(DT), Scale(), nn.Linear(4, 3).to(DT)
        self.mul = _Mul()

    def forward(self, x: Tensor) -> Tensor:
        u = self.p(self.fc0(x))
        weakref.finalize(u, _write, self.mul.s, u.detach())
        return self.fc1(torch.tanh(self.mul(u)))


@pytest.mark.parametrize("engine", [lambda: GhostEngine(max_physical_batch=4),
                                    lambda: GhostEngine(max_physical_batch=1),
                                    lambda: AutoEngine(max_physical_batch=4)],
                         ids=["ghost-4", "ghost-1", "auto-4"])
def test_a_finalizer_run_between_chunks_never_exceeds_c(engine):
    """b088b9d: LOO 1.93 C (chunks of 4) / 2.17 C (chunks of 1)."""
    x, y = outlier_batch()
    try:
        got = loo_distance(engine, _CarriesBetweenChunks, x, y, C)
    except UnsupportedModelError as exc:
        # refused as a write to watched memory when the finalizer runs between chunks; when the
        # collector runs it elsewhere (its tensor left in a cycle by an earlier release of the
        # same test), inside the batch-size proof, the proof recorded its operations and the
        # step is refused as not running the proved program (CI of 37181ff, auto-4)
        assert "written" in str(exc) or "does not run the program" in str(exc), exc
        return
    assert got <= 1 + 1e-9, got


class _Detaches(nn.Module):
    def __init__(self, pair: bool) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, dtype=DT))
        self.pair = pair

    def forward(self, h: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        o = torch.tanh(h * self.a)
        leaf = o.detach().requires_grad_()
        return (o, leaf) if self.pair else leaf


class _DetachNet(nn.Module):
    def __init__(self, pair: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc0, self.m, self.head = nn.Linear(5, 4).to(DT), _Detaches(pair), \
            nn.Linear(4, 3).to(DT)
        self.pair = pair

    def forward(self, x: Tensor) -> Tensor:
        got = self.m(self.fc0(x))
        h = got[0] + 2.0 * got[1] if self.pair else got
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("pair", [False, True], ids=["leaf-only", "with-output"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine,
                                    lambda: GhostEngine(max_physical_batch=1)],
                         ids=["ghost", "auto", "ghost-1"])
def test_a_detached_leaf_output_gives_the_module_no_gradient(engine, pair):
    """b088b9d: norms off by 0.07-0.12, sums by 0.04-0.12."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 5, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g)
    model = _DetachNet(pair)
    groups = ParamGroups.flat(model)
    res = engine().compute(model, ce, x, y, clip_weights(C), groups)
    assert_equal_to_the_loop(res, model, ce, x, y, groups)
