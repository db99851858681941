"""User code that the interpreter runs inside library code (issue 31, found at the merge of the
fourth pass): a ``sys.settrace`` / ``sys.setprofile`` function sees the frames of ``nn.Linear``'s
forward, its return value included, and could rewrite a layer's output, or attach a hook to its
autograd node, in a chain of known modules that the engine runs untraced ("no user code") and
between a layer's forward and the engine's record of the call.

LOO (``tests.engine.test_separability_attacks.loo_distance``) measured on 4cfc9b1 with dpclip's
known loss: the output of the first Linear rewritten in place with 5x its batch mean by a trace
function at the forward's return: 2.00 C under ghost and auto (accepted)."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.known_losses import cross_entropy_per_example
from dpclip.engine.plain_module import python_callbacks
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import data, loo_distance


def _rewrite(out: Tensor) -> None:
    with torch.no_grad():
        out.add_(5 * out.mean(0))


def _rewrite_a_view(out: Tensor) -> None:
    """Through a view of the output (the tracer keys the rewrite by storage)."""
    with torch.no_grad():
        out[:, :3].add_(5 * out[:, :3].mean(0))


def _rewrite_then_scale(out: Tensor) -> None:
    """A second in-place write after the mixing one (the rewrite stays recorded)."""
    with torch.no_grad():
        out.add_(5 * out.mean(0))
        out.mul_(1.0)


def _c_hook(out: Tensor) -> None:
    """A hook no Python code can list, attached to the output's node (the fourth pass's
    attack), rolling the gradient's rows over the batch."""
    torch._C.TensorBase._backward_hooks.__set__(
        out, {0: functools.partial(torch.roll, shifts=1, dims=0)})
    out.grad_fn._register_hook_dict(out)
    torch._C.TensorBase._backward_hooks.__set__(out, None)


def _first_linear_return(act):
    """A trace (or profile) function calling ``act`` on the first Linear's output (width 6) at
    its forward's return."""
    def local(frame, event, arg):
        if event == "return" and frame.f_code.co_name == "forward" \
                and type(frame.f_locals.get("self")) is nn.Linear \
                and isinstance(arg, Tensor) and arg.shape[-1] == 6 and arg.requires_grad:
            act(arg)
        return local if event == "call" else None

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "forward":
            return local
        return None

    def profile(frame, event, arg):
        local(frame, event, arg)

    return trace, profile


@pytest.mark.parametrize("how", ["settrace", "setprofile"])
@pytest.mark.parametrize("act", [_rewrite, _rewrite_a_view, _rewrite_then_scale, _c_hook],
                         ids=["rewrite", "rewrite-a-view", "rewrite-then-scale", "c-hook"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_callback_inside_a_known_chain_never_exceeds_c(engine, act, how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    x, y = data()
    trace, profile = _first_linear_return(act)
    setter = sys.settrace if how == "settrace" else sys.setprofile
    setter(trace if how == "settrace" else profile)
    try:
        got = loo_distance(engine(), model, cross_entropy_per_example, x, y)
    except UnsupportedModelError:
        got = None
    finally:
        setter(None)
    assert got is None or got <= 1 + 1e-9, got


def test_python_callbacks_names_each_kind():
    assert python_callbacks() is None or sys.gettrace() is not None  # (a debugger may be on)
    before = sys.gettrace()
    if before is None:
        sys.settrace(lambda *a: None)
        try:
            assert "sys.settrace" in python_callbacks()
        finally:
            sys.settrace(None)
    sys.setprofile(lambda *a: None)
    try:
        assert python_callbacks() is not None
    finally:
        sys.setprofile(None)
    if before is None:
        assert python_callbacks() is None


def test_honest_chain_under_a_trace_function_runs_traced_and_equal():
    """Under a callback that does nothing, the chain is traced instead of run as known code:
    the same clipped sum as without it (no false refusal)."""
    from tests.engine.test_separability_attacks import clipped_sum

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    x, y = data()
    plain, _ = clipped_sum(GhostEngine(), model, cross_entropy_per_example, x, y)
    sys.setprofile(lambda *a: None)
    try:
        traced, info = clipped_sum(GhostEngine(), model, cross_entropy_per_example, x, y)
    finally:
        sys.setprofile(None)
    assert info.get("engine") == "ghost"
    torch.testing.assert_close(traced, plain, rtol=1e-12, atol=1e-12)
