"""Known losses (dpclip.engine.known_losses): a plain chain of known modules followed by a known
per-example loss is proved separable by semantics, without tracing the loss or the batch-size
proof. Each run-time condition has an attack that must still be traced (and refused where it
mixes), exactly as before the fast path existed."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import dpclip.engine.ghost_forward as gf
from dpclip.engine import GhostEngine, ParamGroups, VmapEngine
from dpclip.engine import separable
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.known_losses import cross_entropy_per_example, known_loss, known_loss_fn
from tests.engine.helpers import DT, clip_weights

B = 6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(DT)


def _data(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 5, generator=g, dtype=DT) * 3, torch.randint(0, 3, (B,), generator=g)


def _run(model, loss, x, y, engine=None):
    engine = engine or GhostEngine()
    return engine.compute(model, loss, x, y, clip_weights(0.5), ParamGroups.flat(model))


@pytest.fixture
def traced(monkeypatch) -> dict[str, int]:
    """Counts the traced operations and the batch-size proofs of the runs in the test."""
    seen = {"ops": 0, "proofs": 0}
    orig = separable.SeparabilityTracer.__torch_dispatch__
    proof = gf.proof_of

    def spy(self, func, types, args=(), kwargs=None):
        seen["ops"] += 1
        return orig(self, func, types, args, kwargs)

    def spy_proof(*a, **k):
        seen["proofs"] += 1
        return proof(*a, **k)

    monkeypatch.setattr(separable.SeparabilityTracer, "__torch_dispatch__", spy)
    monkeypatch.setattr(gf, "proof_of", spy_proof)
    return seen


KNOWN = {
    "helper": (cross_entropy_per_example, False),
    "CrossEntropyLoss": (nn.CrossEntropyLoss(reduction="none"), False),
    "MSELoss": (nn.MSELoss(reduction="none"), True),
}


@pytest.mark.parametrize("name", list(KNOWN))
def test_known_losses_are_not_traced_and_give_the_traced_results(name, traced):
    """The fast path is taken (no traced operation, no batch-size proof) and its clipped sum,
    norms and weights equal, bitwise, those of the same loss written as user code (traced), and
    match the vmap oracle."""
    loss, regression = KNOWN[name]
    x, y = _data()
    if regression:
        y = torch.randn(B, 3, dtype=DT)
    fast = _run(_model(), loss, x, y)
    assert traced == {"ops": 0, "proofs": 0}
    user = (lambda o, t: loss(o, t)) if isinstance(loss, nn.Module) else \
        (lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"))
    slow = _run(_model(), user, x, y)
    assert traced["ops"] > 0 and traced["proofs"] == 1
    assert torch.equal(fast.norms, slow.norms) and torch.equal(fast.weights, slow.weights)
    for n in fast.grads:
        assert torch.equal(fast.grads[n], slow.grads[n]), n
    ref = _run(_model(), loss, x, y, VmapEngine())
    for n in fast.grads:
        torch.testing.assert_close(fast.grads[n], ref.grads[n], rtol=1e-10, atol=1e-12)


class _MixingCE(nn.CrossEntropyLoss):
    def forward(self, o: Tensor, y: Tensor) -> Tensor:
        return super().forward(o - o.mean(0), y)


def _hooked() -> nn.Module:
    loss = nn.CrossEntropyLoss(reduction="none")
    loss.register_forward_hook(lambda m, a, out: out + out.mean())
    return loss


def _instance_forward() -> nn.Module:
    loss = nn.CrossEntropyLoss(reduction="none")
    loss.forward = lambda o, y: nn.functional.cross_entropy(o - o.mean(0), y, reduction="none")
    return loss


ATTACKS = {
    "subclass": lambda: _MixingCE(reduction="none"),
    "hook": _hooked,
    "instance-forward": _instance_forward,
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_mixing_loss_dressed_as_a_known_one_is_traced_and_refused(name, traced):
    x, y = _data()
    loss = ATTACKS[name]()
    assert not known_loss_fn(loss)
    with pytest.raises(UnsupportedModelError, match="not per-example separable|mixes"):
        _run(_model(), loss, x, y)
    assert traced["ops"] > 0


def test_a_patched_class_forward_is_traced_and_refused(monkeypatch, traced):
    def mixing(self, o, y):
        return nn.functional.cross_entropy(o - o.mean(0), y, reduction="none")

    monkeypatch.setattr(nn.CrossEntropyLoss, "forward", mixing)
    loss = nn.CrossEntropyLoss(reduction="none")
    assert not known_loss_fn(loss)
    x, y = _data()
    with pytest.raises(UnsupportedModelError, match="not per-example separable|mixes"):
        _run(_model(), loss, x, y)


def test_a_global_module_hook_is_traced_and_refused(traced):
    h = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, out: out + out.mean() if isinstance(m, nn.CrossEntropyLoss) else None)
    try:
        loss = nn.CrossEntropyLoss(reduction="none")
        assert not known_loss_fn(loss)
        x, y = _data()
        with pytest.raises(UnsupportedModelError):
            _run(_model(), loss, x, y)
    finally:
        h.remove()


def test_reduced_losses_are_refused_as_before(traced):
    """``reduction='mean'``/``'sum'`` are not known losses: refused (one loss, not one per
    example), as before the fast path."""
    x, y = _data()
    for red in ("mean", "sum"):
        loss = nn.CrossEntropyLoss(reduction=red)
        assert not known_loss_fn(loss)
        with pytest.raises(ValueError, match="per example|reduction"):
            _run(_model(), loss, x, y)


def test_a_broadcasting_mse_is_traced_and_refused(traced):
    """``MSELoss`` of a ``(B, 1)`` output against ``(B,)`` targets broadcasts to ``(B, B)``: every
    loss row reads every target. Not known (shapes differ): traced, and refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 1)).to(DT)
    x, _ = _data()
    y = torch.randn(B, dtype=DT)
    loss = nn.MSELoss(reduction="none")
    assert known_loss_fn(loss) and not known_loss(loss, model(x), y, B)
    with pytest.raises(UnsupportedModelError):
        with pytest.warns(UserWarning):
            _run(model, loss, x, y)
    assert traced["ops"] > 0


def test_configurations_and_arguments_outside_the_known_set_are_traced():
    o = torch.randn(B, 3, dtype=DT)
    y = torch.randint(0, 3, (B,))
    assert known_loss(cross_entropy_per_example, o, y, B)
    for loss in (nn.CrossEntropyLoss(reduction="none", weight=torch.ones(3, dtype=DT)),
                 nn.CrossEntropyLoss(reduction="none", label_smoothing=0.1),
                 nn.CrossEntropyLoss(reduction="none", ignore_index=0),
                 lambda a, b: nn.functional.cross_entropy(a, b, reduction="none")):
        assert not known_loss(loss, o, y, B)

    class Sub(Tensor):
        pass

    assert not known_loss(cross_entropy_per_example, o, y.as_subclass(Sub), B)
    assert not known_loss(cross_entropy_per_example, o.as_subclass(Sub), y, B)
    assert not known_loss(cross_entropy_per_example, o[:, :, None], y, B)  # (B, C, 1)
    assert not known_loss(cross_entropy_per_example, o, y.float(), B)  # soft targets: traced
    assert not known_loss(cross_entropy_per_example, o[:B - 1], y[:B - 1], B)

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():  # user code on every operation
        assert not known_loss_fn(cross_entropy_per_example)


def test_a_later_trace_reading_a_known_steps_batch_refuses_it(traced):
    """The fast path marks its batch as a past batch's data, as a traced call does: a later
    (traced) forward that reads it from a global carries other examples into its batch."""
    kept: list[Tensor] = []

    class ReadsOld(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x) + kept[0].sum()

    x1, y1 = _data(1)
    _run(_model(), cross_entropy_per_example, x1, y1)  # known: not traced
    assert traced["ops"] == 0
    kept.append(x1)
    x2, y2 = _data(2)
    with pytest.raises(UnsupportedModelError):
        _run(ReadsOld().to(DT), cross_entropy_per_example, x2, y2)
