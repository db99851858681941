"""Fourth hostile pass over the ghost engine's separability proof (issue 31): the third review's
three open holes, and the attacks found while closing them.

LOO is ``max_j ||S(X) - S(X without j)|| / C`` of the noise-free clipped sum (``loo_distance``); a
sound per-example mechanism has LOO <= 1. Each attack below was accepted on 690ebea with the LOO in
``ACCEPTED_BEFORE`` (ghost and auto alike) and is refused now:

* a tensor autograd saved, rewritten after its last use with dispatch off and its version counter
  set back (the third review's hole): the memory watch now watches every tensor autograd saves
  (``SavedTensorWatch``) and every tensor the call computes, from its birth;
* an intermediate rewritten the same way BEFORE its next use in the forward (found here, 1.63 C);
* the output of a chain of known modules rewritten by the loss before it reads it, and the same
  output, saved by the chain's last Tanh, rewritten after;
* gradient hooks attached with torch functions switched off, by every Python door
  (``Tensor.register_hook``, ``grad_fn.register_prehook`` / ``register_hook``,
  ``torch.autograd.graph.register_multi_grad_hook``, the ``_backward_hooks`` descriptor):
  ``dpclip.engine.hook_watch``;
* the per-layer path's recomputation under ``torch.func.vmap`` reading a global copy of the real
  batch (the third review's hole), computing it with dispatch off, or writing a tensor it made
  with the version counter set back: the recomputation now runs under the separability tracer
  (``dpclip.engine.per_layer.RecomputeTracer``) and is never a vmap fallback.

* ``auto``'s vmap fallback after a run-time refusal: the ghost forward had already run the
  model's code on the whole batch, and what it kept there (a tensor in a global, Python floats
  from ``.tolist()`` on a module attribute, a NumPy copy, the default generator seeded from the
  batch) was read when vmap evaluated each example alone (1.29-4.07 C). ``auto`` (and
  ``GhostEngine(fallback="vmap")``) now decides its engine once per model on a PUBLIC probe batch
  before the model sees private data; a run-time refusal of a private step stops the run
  (``auto-fallback-*``; a switched model lets the probe and the first steps run on ghost).

* a hook attached through torch's C primitives directly (``TensorBase._backward_hooks.__set__`` +
  ``grad_fn._register_hook_dict`` + clearing the descriptor), which autograd gives Python no way to
  list (2.07 C); with a C callable as the hook (``functools.partial(torch.roll, shifts=1,
  dims=0)``: 2.25 C) no Python frame runs in the backward either; with
  ``functools.partial(next, iter([t]))``, ``t`` computed in the forward from the whole batch, no
  torch function or ATen operation runs for it either (1.26 C; so no profiler or mode over the
  backward is a fix). Closed by the hook-free backward (``dpclip.engine.hook_free``): the engine
  calls each node of the graph itself, which runs none of the nodes' hooks.

Found while closing auto's fallback, closed: chunks of one example read each other
(``test_chunks_of_one_cannot_read_each_other``; a chunk of one now runs as a batch of two).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT
from tests.engine.test_hostile_review import (
    _SW,
    _TwoLayers,
    _hidden_write,
    switched_loo,
    third_review_cleanup,
)
from tests.engine.test_separability_attacks import Net, ce, clipped_sum, data


class _RewriteBeforeUse(nn.Module):
    """An intermediate rewritten with dispatch off, its version counter set back, before the
    layer that reads it next."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        if _SW["on"]:
            _hidden_write(h)
        return self.fc2(h)


def _chain() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _chain_tanh_out() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3), nn.Tanh())


def _loss_rewrites_output_first(o: Tensor, y: Tensor) -> Tensor:
    if _SW["on"]:
        _hidden_write(o)
    return ce(o, y)


def _loss_rewrites_output_after(o: Tensor, y: Tensor) -> Tensor:
    loss = ce(o * 3.0, y)
    if _SW["on"]:
        _hidden_write(o)  # the chain's last Tanh saved it: the backward reads it
    return loss


def _off(fn):
    """A ``Net`` middle that attaches a hook to ``h`` with torch functions off (``fn(h)``)."""
    def mid(m, h: Tensor) -> Tensor:
        h = h * 1.0  # a node between the two layers: what it passes back is fc1's gradient
        if _SW["on"] and h.requires_grad:
            with torch._C.DisableTorchFunction():
                fn(h)
        return h
    return lambda: Net(mid)


def _mix_grad(g: Tensor) -> Tensor:
    return g + 5 * g.mean(0)


def _node_prehook(h: Tensor) -> None:
    h.grad_fn.register_prehook(lambda gs: (_mix_grad(gs[0]),))


def _node_posthook(h: Tensor) -> None:
    h.grad_fn.register_hook(lambda gi, go: tuple(None if g is None else _mix_grad(g)
                                                 for g in gi))


def _multi_grad_hook(h: Tensor) -> None:
    # (the hook sees the gradients; it mixes through a tensor hook on the same call)
    torch.autograd.graph.register_multi_grad_hook((h,), lambda gs: None)
    h.register_hook(_mix_grad)


def _descriptor_hook(h: Tensor) -> None:
    torch._C.TensorBase._backward_hooks.__set__(h, {0: _mix_grad})
    h.grad_fn._register_hook_dict(h)


def _descriptor_hook_cleared(h: Tensor) -> None:
    _descriptor_hook(h)
    torch._C.TensorBase._backward_hooks.__set__(h, None)


def _descriptor_hook_cleared_c_callable(h: Tensor) -> None:
    """The same, with a hook that runs no Python frame (a C callable: rows rolled over the
    batch), so no profiler over the backward would see it either."""
    import functools

    torch._C.TensorBase._backward_hooks.__set__(
        h, {0: functools.partial(torch.roll, shifts=1, dims=0)})
    h.grad_fn._register_hook_dict(h)
    torch._C.TensorBase._backward_hooks.__set__(h, None)


def _descriptor_hook_cleared_precomputed(h: Tensor) -> None:
    """The same, with a hook that computes nothing in the backward: ``next`` on an iterator of a
    tensor the forward computed from the whole batch (returned in place of the gradient, the
    gradient passed as ``next``'s default). No Python frame, no torch function and no ATen
    operation runs in the backward: no profiler, torch function mode or dispatch mode over the
    backward could see it (found by seal, issue 31)."""
    import functools

    t = (h + 0.5 * h.sum(0)).detach()
    torch._C.TensorBase._backward_hooks.__set__(h, {0: functools.partial(next, iter([t] * 64))})
    h.grad_fn._register_hook_dict(h)
    torch._C.TensorBase._backward_hooks.__set__(h, None)


def _pops_the_watch_then_rewrites_saved() -> nn.Module:
    """The engine's saved-tensor hooks popped in the forward, then a saved tensor rewritten."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

        def forward(self, x: Tensor) -> Tensor:
            if _SW["on"]:
                try:
                    torch._C._autograd._pop_saved_tensors_default_hooks()
                except RuntimeError:
                    pass
            u = torch.exp(self.fc1(x) * 0.1)
            o = self.fc2(torch.tanh(u))
            if _SW["on"]:
                _hidden_write(u)
            return o
    return M()


_KEEP: dict = {}


class _RecomputeHidden(nn.Module):
    """No ghost rule (the per-layer path). Under vmap it adds the mean of the real batch (kept in
    its call on the batch), computed with torch functions and Python dispatch off."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(6))

    def forward(self, x: Tensor) -> Tensor:
        if _SW["on"] and torch._C._functorch.is_functorch_wrapped_tensor(x):
            with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
                m = _KEEP["x"].mean(0)
            return torch.sin(x * self.w) + 5 * m * self.w
        _KEEP["x"] = x.detach().clone()
        return torch.sin(x * self.w)


class _RecomputeWritesBorn(nn.Module):
    """No ghost rule. Under vmap it writes a tensor it made, with dispatch off and the version
    counter set back (the real batch's mean, kept from the call on the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(6))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.sin(x * self.w)
        if _SW["on"] and torch._C._functorch.is_functorch_wrapped_tensor(x):
            z = y * 1.0
            v = z._version
            with torch.no_grad(), torch._C.DisableTorchFunction(), \
                    torch._C._DisableTorchDispatch():
                z.add_(5 * _KEEP["x"].mean(0))
            torch._C._autograd._unsafe_set_version_counter((z,), (v,))
            return z * self.w
        _KEEP["x"] = x.detach().clone()
        return y * self.w


_STASH: dict = {}


class _StashThenMix(nn.Module):
    """Keeps a copy of its batch in a global when called on real tensors, and under vmap adds
    the copy's mean; its batch reduction (a no-op on values) makes ghost refuse it at run time,
    so auto falls back to vmap after the ghost forward ran it on the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if torch._C._functorch.is_functorch_wrapped_tensor(x):
            if _SW["on"] and "x" in _STASH:
                h = h + 5 * _STASH["x"].mean()
        else:
            _STASH["x"] = x.detach().clone()
        h = h * (1 + 0 * h.mean(0))
        return self.fc2(torch.tanh(h))


class _KeepsThenMixes(nn.Module):
    """Honest while the switch is off, so ``auto``'s public probe and the first steps run on
    ghost (the batch-size proof is then cached). Switched on, its forward on the batch keeps
    something of the batch by ``keep`` through a Python escape (``.numpy()`` / ``.tolist()``),
    which runs no ATen operation (the proved program still matches) and makes the tracer refuse
    the step at run time; evaluated one example at a time under vmap it adds ``5 * read()``. On
    main, ``auto``'s vmap fallback then mixed the examples (LOO in ``ACCEPTED_BEFORE``)."""

    def __init__(self, keep, read) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self._keep, self._read = keep, read

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if torch._C._functorch.is_functorch_wrapped_tensor(x):
            got = self._read(self) if _SW["on"] else None
            if got is not None:
                h = h + 5 * got
        else:
            self._keep(self, x)
        return self.fc2(torch.tanh(h))


def _keep_tensor(m, x: Tensor) -> None:
    """A tensor copy in a global, on every step (legal on ghost: nothing reads it there); the
    switch adds the escape that makes ghost refuse."""
    _STASH["x"] = x.detach().clone()
    if _SW["on"]:
        x.numpy()


def _read_tensor(m):
    return _STASH["x"].mean() if "x" in _STASH else None


def _keep_float(m, x: Tensor) -> None:  # Python floats on a module attribute
    if _SW["on"]:
        m.kept = x.tolist()


def _read_float(m):
    got = getattr(m, "kept", None)
    return None if got is None else sum(map(sum, got)) / (len(got) * len(got[0]))


def _keep_numpy(m, x: Tensor) -> None:  # a NumPy copy in a global list
    if _SW["on"]:
        _STASH.setdefault("np", []).append(x.numpy().copy())


def _read_numpy(m):
    got = _STASH.get("np")
    return torch.from_numpy(got[-1]).mean() if got else None


def _keep_rng(m, x: Tensor) -> None:  # the default generator seeded from the batch
    if _SW["on"]:
        torch.manual_seed(int(abs(x.numpy()).sum() * 1000) % (1 << 31))


def _read_rng(m):
    return torch.rand((), dtype=DT) - 0.5


FOURTH = {
    "intermediate-rewritten-before-use": (_RewriteBeforeUse, ce),
    "known-chain-output-rewritten-by-the-loss": (_chain, _loss_rewrites_output_first),
    "known-chain-saved-output-rewritten-after-use": (_chain_tanh_out,
                                                     _loss_rewrites_output_after),
    "node-prehook-torch-function-off": (_off(_node_prehook), ce),
    "node-posthook-torch-function-off": (_off(_node_posthook), ce),
    "multi-grad-hook-torch-function-off": (_off(_multi_grad_hook), ce),
    "backward-hooks-descriptor": (_off(_descriptor_hook), ce),
    "saved-tensor-watch-popped-by-the-forward": (_pops_the_watch_then_rewrites_saved, ce),
    "per-layer-recompute-hidden-mean": (lambda: _TwoLayers(_RecomputeHidden()), ce),
    "per-layer-recompute-writes-born-tensor": (lambda: _TwoLayers(_RecomputeWritesBorn()), ce),
    # closed by the hook-free backward (dpclip.engine.hook_free)
    "backward-hooks-descriptor-cleared": (_off(_descriptor_hook_cleared), ce),
    "backward-hooks-descriptor-cleared-c-callable": (_off(_descriptor_hook_cleared_c_callable),
                                                     ce),
    "backward-hooks-descriptor-cleared-precomputed": (
        _off(_descriptor_hook_cleared_precomputed), ce),
    "auto-fallback-reads-the-ghost-runs-copy": (lambda: _StashThenMix(), ce),
    # closed by the public probe (auto's engine is decided before the model sees private data):
    # the switch lets the probe and the first steps run on ghost, then the refusal stops the run
    "auto-fallback-after-ghost-steps-tensor-copy": (
        lambda: _KeepsThenMixes(_keep_tensor, _read_tensor), ce),
    "auto-fallback-after-ghost-steps-python-float": (
        lambda: _KeepsThenMixes(_keep_float, _read_float), ce),
    "auto-fallback-after-ghost-steps-numpy-copy": (
        lambda: _KeepsThenMixes(_keep_numpy, _read_numpy), ce),
    "auto-fallback-after-ghost-steps-rng-seeded-by-the-batch": (
        lambda: _KeepsThenMixes(_keep_rng, _read_rng), ce),
}

#: LOO measured on 690ebea (before this pass; ghost and auto alike)
ACCEPTED_BEFORE = {
    "intermediate-rewritten-before-use": 1.63,
    "known-chain-output-rewritten-by-the-loss": 1.035,
    "known-chain-saved-output-rewritten-after-use": 1.50,
    "node-prehook-torch-function-off": 2.07,
    "node-posthook-torch-function-off": 2.07,
    "multi-grad-hook-torch-function-off": 2.07,
    "backward-hooks-descriptor": 2.07,
    "saved-tensor-watch-popped-by-the-forward": 1.003,
    "per-layer-recompute-hidden-mean": 1.06,
    "per-layer-recompute-writes-born-tensor": 1.025,
    "backward-hooks-descriptor-cleared": 2.07,  # (closed by dpclip.engine.hook_free)
    "backward-hooks-descriptor-cleared-c-callable": 2.25,  # (b6642d1 + autofb; closed: hook_free)
    "backward-hooks-descriptor-cleared-precomputed": 1.26,  # (seal, 660bede; closed: hook_free)
    "auto-fallback-reads-the-ghost-runs-copy": 1.29,  # auto only (1.96 on b6642d1)
    # auto only, measured on b6642d1 (ghost refuses them)
    "auto-fallback-after-ghost-steps-tensor-copy": 1.96,
    "auto-fallback-after-ghost-steps-python-float": 1.96,
    "auto-fallback-after-ghost-steps-numpy-copy": 1.96,
    "auto-fallback-after-ghost-steps-rng-seeded-by-the-batch": 4.07,
}

#: none open: the cleared-descriptor hooks are closed by the hook-free backward
#: (dpclip.engine.hook_free; LOO in ACCEPTED_BEFORE)
_OPEN4: dict[str, str] = {}
#: open under auto only (ghost refuses the model); closed by auto's public probe (issue 31)
_OPEN4_AUTO: dict[str, str] = {}
#: models that mix with the switch off too (auto runs them on vmap from the first step)
_ALWAYS_MIX = {"auto-fallback-reads-the-ghost-runs-copy"}


def fourth_loo(engine, name: str) -> float | None:
    """LOO of attack ``name`` under ``engine`` after honest calls (switch off), or None when a
    step was refused."""
    build, loss = FOURTH[name]
    try:
        return switched_loo(engine, build, data, loss, None)
    finally:
        _KEEP.clear()
        _STASH.clear()


@pytest.mark.parametrize("engine,name", [
    pytest.param(e, n, marks=pytest.mark.xfail(strict=True, reason=_OPEN4[n])) if n in _OPEN4 else
    pytest.param(e, n, marks=pytest.mark.xfail(strict=True, reason=_OPEN4_AUTO[n]))
    if n in _OPEN4_AUTO and e is AutoEngine else (e, n)
    for n in FOURTH for e in (GhostEngine, AutoEngine)])
def test_fourth_pass_attack_never_exceeds_c(name, engine):
    """Refused, or LOO <= C."""
    got = fourth_loo(engine, name)
    assert got is None or got <= 1 + 1e-9, got


@pytest.mark.parametrize("name", [n for n in FOURTH if n not in _ALWAYS_MIX])
def test_every_attack_is_honest_when_switched_off(name):
    """With the switch off each model runs on ghost and equals the float64 per-example oracle
    (the attacks are refused for what they do, not for what they are)."""
    from dpclip.engine import NaiveEngine

    build, loss = FOURTH[name]
    _SW["on"] = False
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = data()
    try:
        got, info = clipped_sum(GhostEngine(), model, loss, x, y)
        want, _ = clipped_sum(NaiveEngine(), model, loss, x, y)
    finally:
        third_review_cleanup()
        _KEEP.clear()
    assert info["engine"] == "ghost"
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("build", [_RecomputeHidden, _RecomputeWritesBorn])
def test_per_layer_recompute_attacks_never_run(build):
    """The per-layer path no longer runs the module's Python again (thirteenth review: it replays
    the call's proved operations, tests/engine/test_review13_recompute.py): the attacks' branch for
    functorch's tensors is never taken, so with the switch on the release is the honest one, on
    ghost under auto (before: refused as entry 100)."""
    torch.manual_seed(0)
    model = _TwoLayers(build()).to(DT)
    x, y = data()
    try:  # (the traced path: auto's compiled path runs no module code at all)
        honest, _ = clipped_sum(AutoEngine(compiled=False), model, ce, x, y)
        _SW["on"] = True
        got, info = clipped_sum(AutoEngine(compiled=False), model, ce, x, y)
    finally:
        _SW["on"] = False
        _KEEP.clear()
    assert info["engine"] == "ghost" and info["per_layer"] == ("mid",)
    assert torch.equal(got, honest)


def test_saved_tensor_watch_keeps_autograds_version_check():
    """Under the engine's saved-tensor hooks autograd skips its own version check: the watch
    makes it, with autograd's message (an in-place write the trace sees, after the save)."""
    from dpclip.engine.memory_watch import SavedTensorWatch

    x = torch.randn(3, 2, dtype=DT, requires_grad=True)
    with SavedTensorWatch(lambda t: None):
        u = torch.exp(x)
        s = u.sum()
    u.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.backward()
    with SavedTensorWatch(lambda t: None):
        u = torch.exp(x)
        s = torch.tanh(u).sum()
    (g,) = torch.autograd.grad(s, x)
    want = (1 - torch.tanh(torch.exp(x)) ** 2) * torch.exp(x)
    assert torch.allclose(g, want)


def test_saved_tensor_watch_leaves_no_reference_cycle():
    """A step refused before its backward frees its graph: the saved tensor is kept as a detached
    alias, not as the output itself (which would tie its node to itself)."""
    import gc
    import weakref

    from dpclip.engine.memory_watch import SavedTensorWatch

    refs = []
    for _ in range(3):
        x = torch.randn(50, 50, requires_grad=True)
        with SavedTensorWatch(lambda t: None):
            u = torch.exp(x * 1.0)
            s = torch.tanh(u).sum()
        refs.append(weakref.ref(u))
        del x, u, s
    gc.collect()
    assert all(r() is None for r in refs)


def test_hook_watch_restores_torch():
    """The doors are wrapped only while a step runs, and nested watches share them."""
    from dpclip.engine.hook_watch import HookWatch

    before = (torch.Tensor.register_hook,
              torch.autograd.function._HookMixin.__dict__["_register_hook"])
    with HookWatch() as a:
        with HookWatch() as b:
            assert torch.Tensor.register_hook is not before[0]
            t = torch.zeros(2, requires_grad=True)
            t.register_hook(lambda g: g)
        assert torch.Tensor.register_hook is not before[0]
    assert (torch.Tensor.register_hook,
            torch.autograd.function._HookMixin.__dict__["_register_hook"]) == before
    assert a.found and b.found
    with HookWatch() as c:
        pass
    assert c.found is None and c.check([torch.zeros(2)]) is None
    assert c.check([t]) is not None  # (t has a hook)


def test_foreign_saved_tensor_hooks_are_still_refused():
    """The engine's own watch is not user code; user hooks on top of it are."""
    from dpclip.engine.memory_watch import SavedTensorWatch, foreign_saved_tensor_hooks

    assert foreign_saved_tensor_hooks() is None
    with SavedTensorWatch(lambda t: None):
        assert foreign_saved_tensor_hooks() is None
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            assert foreign_saved_tensor_hooks() is not None
    with contextlib.ExitStack():
        assert foreign_saved_tensor_hooks() is None


# ------------------------------------------------- fourth pass: the refusals (docs/errors.md)


def _refused(build, loss, match: str) -> None:
    """An honest call, then the attack switched on: refused under ghost and auto's traced path
    with ``match`` (auto's compiled path runs the proved graph, not the switched code:
    tests/engine/test_auto_compiled.py)."""
    for engine in (GhostEngine(), AutoEngine(compiled=False)):
        torch.manual_seed(0)
        model = build().to(DT)
        x, y = data()
        try:
            clipped_sum(engine, model, loss, x, y)
            _SW["on"] = True
            with pytest.raises(UnsupportedModelError, match=match):
                clipped_sum(engine, model, loss, x, y)
        finally:
            third_review_cleanup()
            _KEEP.clear()


def test_error_99_gradient_hook_attached_unseen():
    """docs/errors.md entry 99: a hook attached with torch functions off is refused when the loss
    returns, under ghost and auto (never a vmap fallback)."""
    _refused(*FOURTH["node-prehook-torch-function-off"],
             match=r"a hook on an autograd node \(grad_fn.register_hook / register_prehook\) was "
                   "registered in the call where the trace does not see it")
    _refused(*FOURTH["backward-hooks-descriptor"],
             match="a gradient hook on a tensor of the call was registered in the call")


def test_error_101_a_tensor_of_the_call_rewritten_unseen():
    """docs/errors.md entry 101: a tensor the call computed (or autograd saved) rewritten by no
    operation the trace sees."""
    _refused(*FOURTH["intermediate-rewritten-before-use"],
             match="the memory of a tensor the call computed was written or replaced in the call "
                   "before addmm by no operation the trace sees")
    _refused(*FOURTH["known-chain-saved-output-rewritten-after-use"],
             match="the memory of (the model's output|a tensor autograd saved for the backward) "
                   "was written or replaced in the call before the loss function returned")


def test_backward_rules_of_the_recomputation_keep_or_mix_as_they_must():
    """The tracer's rules for the backward operations the per-layer recomputation runs under vmap:
    ``slice_backward`` keeps the batch blocks unless it slices the batch dimension itself, and
    ``select_backward`` moves the batch dimension past the one it puts back (adversarial: a slice
    of the batch, written back, carries some examples' rows into other positions)."""
    from dpclip.engine.separable import MIXED, SeparabilityTracer

    aten = torch.ops.aten
    g = torch.randn(4, 3, 5, dtype=DT)
    for dim, start in ((1, 0), (2, 1), (0, 0)):
        tr = SeparabilityTracer(4)
        tr.mark(g, (0, 1))
        sizes = list(g.shape)
        sizes[dim] += start + (2 if dim else 0)
        end, want = start + g.shape[dim], (0, 1)
        with tr:
            out = aten.slice_backward(g, sizes, dim, start, end, 1)
        assert tr.layout(out) == want, (dim, tr.layout(out))
    tr = SeparabilityTracer(4)
    tr.mark(g, (0, 1))
    with tr:
        out = aten.slice_backward(g, [6, 3, 5], 0, 1, 5, 1)  # the batch shifted by one row
    assert tr.layout(out) is MIXED
    for dim, want in ((0, (1, 1)), (1, (0, 1)), (3, (0, 1))):
        tr = SeparabilityTracer(4)
        tr.mark(g, (0, 1))
        sizes = list(g.shape)
        sizes.insert(dim, 7)
        with tr:
            out = aten.select_backward(g, sizes, dim, 2)
        assert tr.layout(out) == want, (dim, tr.layout(out))


# ------------------------------------------- found while closing auto's fallback (closed)


_PREV: dict = {}


class _ReadsThePreviousChunk(nn.Module):
    """Adds the mean of the input its previous call saw (a global), then keeps its own: under
    ``max_physical_batch=1`` every chunk is one example, and a chunk of one is not traced."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if "x" in _PREV:
            h = h + 5 * _PREV["x"].mean()
        _PREV["x"] = x.detach().clone()
        return self.fc2(torch.tanh(h))


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_chunks_of_one_cannot_read_each_other(engine):
    """Found by autofb: with ``max_physical_batch=1`` a chunk of one example was not traced ("it
    cannot mix"), and the model that reads the previous chunk's input from a global was accepted
    by ghost and auto (LOO 2.70 C on b6642d1 and 26a8926; max_physical_batch=2 refuses it). Now
    refused: a chunk of one runs as a batch of two, the copy weighted 0 (``dpclip.engine.ghost``;
    more scenarios: tests/engine/test_chunks_of_one.py)."""
    from tests.engine.test_separability_attacks import loo_distance

    torch.manual_seed(0)
    model = _ReadsThePreviousChunk().to(DT)
    x, y = data()
    try:
        got = loo_distance(engine(max_physical_batch=1), model, ce, x, y)
    except UnsupportedModelError:
        got = None
    finally:
        _PREV.clear()
    assert got is None or got <= 1 + 1e-9, got
