"""Twentieth hostile review (of 7bcb1d1), each attack accepted there by ghost and auto:

1. Eval BatchNorm (a ruled layer) whose ``running_mean`` / ``running_var`` are swapped, for its
   call only, for the batch's own (detached) statistics: the layer's output was marked per-example
   whatever its buffers carried; ``layer_config`` skipped the buffer dictionary, and the buffers
   were back before the step ended (LOO 2.23 C at B 8). Scaled statistics swapped in alike gave
   wrong per-example norms. Now a ruled layer's own parameters and buffers are part of its
   configuration (identity and version), checked at its call: refused.
2. A Conv1d subclass holding its padding list and mode on the CLASS (deleted from the instance),
   set there to the batch-shifting list of the nineteenth review for the call only: the rule read
   the honest class values after the backward (LOO 2.14 C at B 8). Now a subclass that defines
   class-level data takes the per-layer path (its replay sees the padding), and a data descriptor
   hiding an instance attribute is part of the configuration check.
3. A ``__del__`` fired when the engine dropped a per-layer call's arguments, after the backward and
   after the memory watch had finished, rolled a ruled layer's input in place; the engine skipped
   tensors whose version had moved, leaving them to version checks that had already run (LOO
   1.84 C). Now a version change by the time the engine reads the input is refused, and so is a
   change of its bytes with the version set back (the fingerprint taken when the layer returned);
   since the twenty-third review the engine also holds what the calls kept until its rules have
   read, so such a finalizer runs after the reads.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from dpclip.engine import naive_per_example_grads
from tests.engine.helpers import (DT, assert_equal_to_the_loop, assert_matches_the_loop, ce,
                                  clip_weights, loo_distance, outlier_batch)

C = 0.5
ENGINES = pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])


class _BatchStats(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc0, self.bn, self.fc1 = nn.Linear(5, 4).to(DT), nn.BatchNorm1d(4).to(DT), \
            nn.Linear(4, 3).to(DT)
        self.how = how
        self.eval()

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc0(x)
        was = self.bn.running_mean, self.bn.running_var
        if self.how == "batch":
            d = h.detach()
            self.bn.running_mean, self.bn.running_var = d.mean(0), d.var(0, correction=0) + 1e-3
        else:
            self.bn.running_var = was[1] * 64
        h = self.bn(h)
        self.bn.running_mean, self.bn.running_var = was
        return self.fc1(h)


@ENGINES
@pytest.mark.parametrize("how", ["batch", "scaled"])
def test_batchnorm_statistics_swapped_for_the_call_are_refused(engine, how):
    x, y = outlier_batch()
    model = _BatchStats(how)
    with pytest.raises(UnsupportedModelError, match="another configuration"):
        engine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))


_SHIFT = (1, 1, 0, 0, 1, -1)


class _ClassConv(nn.Conv1d):
    _reversed_padding_repeated_twice = (1, 1)
    padding_mode = "circular"


class _ClassPadding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = _ClassConv(2, 3, 3, padding=1, padding_mode="circular").to(DT)
        del self.conv._reversed_padding_repeated_twice, self.conv.padding_mode
        self.fc = nn.Linear(12, 3).to(DT)

    def forward(self, x: Tensor) -> Tensor:
        was = _ClassConv._reversed_padding_repeated_twice, _ClassConv.padding_mode
        _ClassConv._reversed_padding_repeated_twice, _ClassConv.padding_mode = _SHIFT, "constant"
        try:
            h = self.conv(x)
        finally:
            _ClassConv._reversed_padding_repeated_twice, _ClassConv.padding_mode = was
        return self.fc(torch.tanh(h).flatten(1))


class _PropertyConv(nn.Conv1d):
    pass


class _PropertyPadding(nn.Module):
    """An honest subclass; the forward installs a property on it for the call only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = _PropertyConv(2, 3, 3, padding=1, padding_mode="circular").to(DT)
        self.fc = nn.Linear(12, 3).to(DT)

    def forward(self, x: Tensor) -> Tensor:
        _PropertyConv.padding_mode = property(lambda s: "constant")
        _PropertyConv._reversed_padding_repeated_twice = property(lambda s: _SHIFT)
        try:
            h = self.conv(x)
        finally:
            del _PropertyConv.padding_mode, _PropertyConv._reversed_padding_repeated_twice
        return self.fc(torch.tanh(h).flatten(1))


@ENGINES
@pytest.mark.parametrize("make", [_ClassPadding, _PropertyPadding], ids=["class", "property"])
def test_a_padding_held_by_the_class_never_exceeds_c(engine, make):
    """7bcb1d1: the class variant accepted, LOO 2.14 C. Refused, or sound (auto: vmap)."""
    g = torch.Generator().manual_seed(4)
    x, y = 3 * torch.randn(8, 2, 4, generator=g, dtype=DT), torch.randint(0, 3, (8,), generator=g)
    try:
        got = loo_distance(engine, make, x, y, C)
    except UnsupportedModelError:
        return
    assert got <= 1 + 1e-9, got


def test_a_subclass_with_class_data_takes_the_per_layer_path_and_methods_only_keep_the_rule():
    from dpclip.engine.ghost_rules import _rule_for

    class Methods(nn.Conv1d):
        def extra_repr(self) -> str:
            return "methods only"

    assert _rule_for(Methods(2, 3, 3)) is not None
    assert _rule_for(_ClassConv(2, 3, 3)) is None


_FIRED: list[int] = []
_ARMED = [True]  # (off while the float64 loop computes the oracle)


class _Trigger:
    def __init__(self, raw: bool) -> None:
        self.t, self.raw = None, raw

    def __del__(self) -> None:
        t = self.t
        if type(t) is not torch.Tensor or not _ARMED[0]:
            return
        version = t._version
        with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            t.copy_(t.roll(1, 0))  # example i's row now holds example i - 1's
        if self.raw:
            torch._C._autograd._unsafe_set_version_counter((t,), (version,))
        _FIRED.append(1)


class _NoRule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6, dtype=DT) / 3)

    def forward(self, h: Tensor, trigger: _Trigger) -> Tensor:
        return torch.tanh(h @ self.w)


class _DropsATrigger(nn.Module):
    def __init__(self, raw: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc0, self.custom, self.fc1 = nn.Linear(5, 6).to(DT), _NoRule(), nn.Linear(6, 3).to(DT)
        self.raw = raw

    def forward(self, x: Tensor) -> Tensor:
        trigger = _Trigger(self.raw)
        z = self.custom(torch.tanh(self.fc0(x)), trigger)
        trigger.t = z  # fc1's input, rewritten when the engine drops the call's arguments
        return self.fc1(z)


@ENGINES
@pytest.mark.parametrize("raw", [False, True], ids=["version-moves", "version-set-back"])
def test_a_finalizer_that_rewrites_a_layer_input_after_the_backward_changes_nothing(engine, raw):
    """7bcb1d1: the version-moving write accepted, LOO 1.84 C. Refused since the twentieth
    review's fix (the version checked at the read); since the twenty-third's, the engine holds the
    call's arguments until its rules have read the inputs, so the finalizer runs after the reads:
    the release is the float64 loop's (or the step is refused)."""
    g = torch.Generator().manual_seed(0)
    x, y = 3 * torch.randn(4, 5, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
    model = _DropsATrigger(raw)
    groups = ParamGroups.flat(model)
    _FIRED.clear()
    try:
        res = engine().compute(model, ce, x, y, clip_weights(C), groups)
    except UnsupportedModelError as exc:
        assert "after the layer used it" in str(exc)
        return
    assert _FIRED
    _ARMED[0] = False
    try:
        per_ex = naive_per_example_grads(_DropsATrigger(raw), ce, x, y)
    finally:
        _ARMED[0] = True
    assert_matches_the_loop(res, per_ex, groups, 4)
    assert loo_distance(engine, lambda: _DropsATrigger(raw), x, y, C) <= 1 + 1e-9


def test_an_honest_eval_batchnorm_still_runs_on_ghost_equal_to_the_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    model[1].running_mean.normal_()
    model[1].running_var.uniform_(0.5, 2.0)
    model.eval()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 5, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g)
    groups = ParamGroups.flat(model)
    res = AutoEngine().compute(model, ce, x, y, clip_weights(C), groups)
    assert_equal_to_the_loop(res, model, ce, x, y, groups)
