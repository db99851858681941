"""The ghost engine's hook-free backward (``dpclip.engine.hook_free``, issue 31): the gradients
``torch.autograd.grad(total, edges)`` returns, with no hook of the graph run, and the same ATen
operations (no parameter-gradient product)."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._python_dispatch import TorchDispatchMode

from dpclip.engine.hook_free import hook_free_grad
from tests.engine.helpers import DT


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))


class _Graphs(nn.Module):
    """Linear layers, a broadcast bias-like add (summed back by validate_outputs), a split whose
    second half is unused (a None input to its node), a shared subexpression, a float32 detour
    (a dtype cast back), and a layer whose output does not reach the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(5, 8), nn.Linear(4, 4), nn.Linear(4, 3)
        self.dead = nn.Linear(5, 2)
        self.shift = nn.Parameter(torch.randn(4, dtype=DT))

    def forward(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        o1 = self.fc1(x)
        a, _ = torch.tanh(o1).split(4, dim=1)
        s = a + self.shift  # (B, 4) + (4,)
        o2 = self.fc2(s * s.float().sigmoid().to(DT))
        o3 = self.fc3(torch.relu(o2) + s)
        o4 = self.dead(x)
        return o3, [o1, o2, o3, o4]


def _case(seed: int = 0):
    torch.manual_seed(seed)
    model = _Graphs().to(DT)
    x = torch.randn(6, 5, dtype=DT)
    y = torch.randint(0, 3, (6,))
    out, outs = model(x)
    total = nn.functional.cross_entropy(out, y, reduction="none").sum()
    return model, total, outs


def test_equals_autograd_grad_and_runs_its_operations():
    model, total, outs = _case()
    edges = [get_gradient_edge(o) for o in outs]
    with _Count() as mine:
        got = hook_free_grad(total, edges)
    model2, total2, outs2 = _case()
    with _Count() as theirs:
        want = torch.autograd.grad(total2, [get_gradient_edge(o) for o in outs2],
                                   allow_unused=True)
    assert got[3] is None and want[3] is None  # the dead layer: not reached
    for g, w in zip(got[:3], want[:3]):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)  # (the engine's order of summation: bit for bit)
    assert all(p.grad is None for p in model.parameters())  # no AccumulateGrad ran
    skip = {"view", "detach", "alias"}  # (the root's own view)
    assert {k: v for k, v in mine.ops.items() if k not in skip} == \
        {k: v for k, v in theirs.ops.items() if k not in skip}
    assert mine.ops["mm"] == theirs.ops["mm"] == 2  # input gradients of fc2, fc3 only


def _attach(kind: str, h: Tensor, ran: list) -> None:
    def mix(g: Tensor) -> Tensor:
        ran.append(kind)
        return g + 5 * g.sum(0)

    if kind == "tensor-hook":
        h.register_hook(mix)
    elif kind == "node-prehook":
        h.grad_fn.register_prehook(lambda gs: (mix(gs[0]),))
    elif kind == "node-posthook":
        h.grad_fn.register_hook(lambda gi, go: tuple(None if g is None else mix(g) for g in gi))
    elif kind == "descriptor-cleared":
        torch._C.TensorBase._backward_hooks.__set__(h, {0: mix})
        h.grad_fn._register_hook_dict(h)
        torch._C.TensorBase._backward_hooks.__set__(h, None)
    elif kind == "descriptor-cleared-precomputed":
        t = (h + 5 * h.sum(0)).detach()
        torch._C.TensorBase._backward_hooks.__set__(
            h, {0: functools.partial(next, iter([t] * 8))})
        h.grad_fn._register_hook_dict(h)
        torch._C.TensorBase._backward_hooks.__set__(h, None)


@pytest.mark.parametrize("kind", ["tensor-hook", "node-prehook", "node-posthook",
                                  "descriptor-cleared", "descriptor-cleared-precomputed"])
def test_no_hook_of_the_graph_runs(kind):
    """Every door to a hook on an interior node: the hook-free gradients are the graph's without
    the hook (and the hook never ran); autograd's engine runs it (the test can fail)."""
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(5, 6).to(DT), nn.Linear(6, 3).to(DT)
    x = torch.randn(4, 5, dtype=DT)

    def graph(hooked: bool, ran: list):
        o1 = fc1(x)
        h = torch.tanh(o1) * 1.0
        if hooked:
            _attach(kind, h, ran)
        o2 = fc2(h)
        return (o2 ** 2).sum(), [get_gradient_edge(o1), get_gradient_edge(o2)]

    ran: list = []
    want = hook_free_grad(*graph(False, ran))
    got = hook_free_grad(*graph(True, ran))
    assert ran == []
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    total, edges = graph(True, ran)
    engine = torch.autograd.grad(total, edges)
    assert not torch.allclose(engine[0], want[0])  # what the hook would have done


def test_no_graph_and_no_edges():
    x = torch.randn(3, dtype=DT, requires_grad=True)
    assert hook_free_grad(torch.zeros((), dtype=DT), []) == []
    y = (x * 2).sum()
    other = torch.randn(3, dtype=DT, requires_grad=True) * 3
    assert hook_free_grad(y, [get_gradient_edge(other)]) == [None]


def test_the_walk_frees_no_saved_tensor_so_no_finalizer_runs_in_it():
    """The walk keeps every saved tensor with the graph (the chunk releases the graph where its
    checks run): freeing one inside the backward ran a finalizer the forward had attached to it
    after the loss had returned (hundred-and-twenty-seventh hostile review: it rewrote another
    saved tensor, LOO 11 C). The gradients are unchanged."""
    import weakref

    from dpclip.engine.memory_watch import SavedTensorWatch

    torch.manual_seed(0)
    fc = nn.Linear(5, 6).to(DT)
    x = torch.randn(4, 5, dtype=DT)
    ran = []
    with SavedTensorWatch(lambda t: None):
        o = fc(x)
        t = torch.tanh(o * 1.0)
        total = (t * t).sum()
    node = t.grad_fn  # TanhBackward0: saves its result
    with torch._C.DisableTorchFunction():
        weakref.finalize(t.untyped_storage(), ran.append, "finalizer")
    want = 2 * t.detach() * (1 - t.detach() ** 2)
    del t
    (got,) = hook_free_grad(total, [get_gradient_edge(o)])
    assert ran == []  # (before: the walk let the saved result go, and the finalizer ran)
    assert torch.equal(node._saved_result, torch.tanh(o.detach() * 1.0))  # (still held)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    del node, total
    assert ran == ["finalizer"]  # released with the graph


def _engine_backwards(monkeypatch, model, loss_fn) -> int:
    """How many times one ghost step walked the graph itself (``hook_free_grad``)."""
    import dpclip.engine.ghost as ghost_mod
    from dpclip.engine import GhostEngine, ParamGroups
    from tests.engine.helpers import clip_weights
    from tests.engine.test_separability_attacks import data

    walks = []

    def counted(total, edges):
        walks.append(len(edges))
        return hook_free_grad(total, edges)

    monkeypatch.setattr(ghost_mod, "hook_free_grad", counted)
    x, y = data()
    GhostEngine().compute(model, loss_fn, x, y, clip_weights(1.0), ParamGroups.flat(model))
    return len(walks)


def test_walk_only_where_user_code_ran(monkeypatch):
    """A chain of known modules with a known loss (no user code between the graph's nodes and
    the backward, so no hook can be on them) runs on autograd's engine; a user loss, or a model
    with its own forward, is walked (its code could have attached a hook the engine cannot list)."""
    from dpclip.engine.known_losses import cross_entropy_per_example
    from tests.engine.test_separability_attacks import Net, ce

    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    assert _engine_backwards(monkeypatch, chain, cross_entropy_per_example) == 0
    assert _engine_backwards(monkeypatch, chain, ce) == 1
    assert _engine_backwards(monkeypatch, Net().to(DT), cross_entropy_per_example) == 1
