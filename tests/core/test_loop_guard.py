"""The loop rules of make_private (dpclip.training.loop_guard), each attacked the way a user's loop breaks
it (issue 33): the Opacus habit, a leftover backward, rejection sampling, an in-place edit."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpclip import make_private
from dpclip.training.loop_guard import LoopRuleError


def _setup(steps=10, optimizer=True, **kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    dp = make_private(model, opt, (x, y), noise_multiplier=1.0, steps=steps, batch_size=10,
                      verbose=False, **kw)
    return model, opt, dp


def test_the_opacus_habit_fails_on_the_second_batch():
    """loss.backward(); opt.step() over dp.loader, never dp.backward: used to train every batch
    with raw gradients (200 batches for a 10-step plan, epsilon 0)."""
    model, opt, dp = _setup()
    drawn = 0
    with pytest.raises(LoopRuleError, match="never released by dp.backward"):
        for x, y in dp.loader:
            drawn += 1
            if drawn > 3:  # the old loader never stopped (steps never advanced)
                break
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            try:
                opt.step()
            except LoopRuleError:
                pass  # the step is refused too; the loader must stop on its own
    assert drawn == 1 and dp.steps == 0


def test_optimizer_step_without_a_private_backward_is_refused():
    model, opt, dp = _setup()
    x, y = dp.sample()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(LoopRuleError, match="no private gradient was released"):
        opt.step()


def test_a_second_step_on_one_release_is_refused():
    model, opt, dp = _setup()
    x, y = dp.sample()
    dp.backward(x, y)
    opt.step()
    with pytest.raises(LoopRuleError, match="no private gradient was released"):
        opt.step()


def test_a_leftover_backward_after_dp_backward_is_refused():
    """F.cross_entropy(m(x), y).backward() after dp.backward adds a raw gradient to p.grad."""
    model, opt, dp = _setup()
    x, y = dp.sample()
    opt.zero_grad()
    dp.backward(x, y)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(LoopRuleError, match="not the gradient dp.backward released"):
        opt.step()


def test_an_in_place_edit_of_a_released_gradient_is_refused():
    model, opt, dp = _setup()
    x, y = dp.sample()
    dp.backward(x, y)
    next(model.parameters()).grad.add_(1.0)
    with pytest.raises(LoopRuleError, match="not the gradient dp.backward released"):
        opt.step()


def test_a_skipped_batch_is_refused_on_the_next_draw():
    """`if len(x) == 0: continue` is rejection sampling: the inclusion rate per released step
    is no longer the accounted sample rate."""
    model, opt, dp = _setup()
    with pytest.raises(LoopRuleError, match="never released"):
        for i, (x, y) in enumerate(dp.loader):
            if i > 3:
                break
            if i == 0:
                continue  # skip the first batch (as `if len(x) == 0: continue` would)
            dp.step(x, y)
    assert dp.steps == 0


def test_a_failed_backward_leaves_the_batch_unreleased():
    model, opt, dp = _setup(loss_fn=lambda out, y: F.cross_entropy(out, y))  # a mean: refused
    x, y = dp.sample()
    with pytest.raises(ValueError):
        dp.backward(x, y)
    with pytest.raises(LoopRuleError, match="or its backward failed"):
        dp.sample()


def test_an_in_place_edit_of_the_drawn_batch_is_refused():
    """x.sub_(x.mean(0)) keeps the tensor's identity but mixes the examples."""
    model, opt, dp = _setup()
    x, y = dp.sample()
    x.sub_(x.mean(0))
    with pytest.raises(LoopRuleError, match="changed in place"):
        dp.backward(x, y)


def test_an_in_place_edit_of_a_dict_leaf_is_refused():
    g = torch.Generator().manual_seed(0)
    inputs = {"a": torch.randn(100, 3, generator=g), "b": torch.randn(100, 2, generator=g)}
    y = torch.randint(0, 2, (100,), generator=g)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 2)

        def forward(self, a, b):
            return self.fc(torch.cat([a, b], 1))

    dp = make_private(Two(), None, (inputs, y), noise_multiplier=1.0, steps=3, batch_size=10,
                      verbose=False, engine="vmap")
    xb, yb = dp.sample()
    xb["b"].mul_(2.0)
    with pytest.raises(LoopRuleError, match="changed in place"):
        dp.backward(xb, yb)


def test_the_documented_loop_runs_every_planned_step_and_stops():
    model, opt, dp = _setup(steps=7)
    n = 0
    for _ in range(dp.epochs):
        for x, y in dp.loader:
            opt.zero_grad()
            dp.backward(x, y)
            opt.step()
            n += 1
    assert n == 7 == dp.steps and dp.exhausted


def test_dp_step_and_a_resumed_run_on_the_same_optimizer():
    """The most recent PrivateTraining on an optimizer is the one that checks its steps."""
    model, opt, dp = _setup()
    x, y = dp.sample()
    dp.step(x, y)
    ck = dp.state_dict()
    g = torch.Generator().manual_seed(0)  # the same data (a resume on other data is refused)
    xs = torch.randn(200, 5, generator=g)
    dp2 = make_private(model, opt, (xs, (xs[:, 0] > 0).long()),
                       noise_multiplier=1.0, steps=10, batch_size=10, verbose=False)
    dp2.load_state_dict(ck)
    x, y = dp2.sample()
    dp2.step(x, y)
    assert dp2.steps == 2


def test_detach_frees_the_optimizer_for_public_fine_tuning():
    model, opt, dp = _setup(steps=1)
    x, y = dp.sample()
    dp.step(x, y)
    dp.loop_guard.detach()
    F.cross_entropy(model(x[:0].new_zeros(4, 5)), torch.zeros(4).long()).backward()
    opt.step()  # no longer checked


# ------------------------------------------- eighty-eighth hostile review (the user's loop)

def test_a_closure_passed_to_the_optimizer_step_is_refused():
    """torch's optimizers call the closure inside step, after the pre-step check: its backward
    replaced the released gradient with a raw one (LOO of the applied update 928 C)."""
    model, opt, dp = _setup()
    x, y = dp.sample()
    dp.backward(x, y)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(LoopRuleError, match="closure"):
        opt.step(closure)
    with pytest.raises(LoopRuleError, match="closure"):
        opt.step(closure=closure)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_frozen_parameters_raw_gradient_is_refused():
    """A parameter frozen when make_private was built, unfrozen for a raw backward and frozen
    again: its p.grad was applied by the optimizer unclipped (11.4 C)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = make_private(model, opt, (x, y), noise_multiplier=1.0, steps=10, batch_size=10,
                      verbose=False)
    xb, yb = dp.sample()
    model[2].bias.requires_grad_(True)
    F.cross_entropy(model(xb), yb).backward()
    model[2].bias.requires_grad_(False)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = None
    dp.backward(xb, yb)
    with pytest.raises(LoopRuleError, match="did not release"):
        opt.step()


def test_a_checkpoint_with_an_unreleased_draw_is_refused():
    """A batch drawn, then the state saved and loaded into a new PrivateTraining: the loop could
    draw again (rejection sampling: a target in 0 of 200 released batches at q = 0.5)."""
    model, opt, dp = _setup()
    dp.sample()
    with pytest.raises(LoopRuleError, match="never released"):
        dp.state_dict()


def _resume_setup(activation, loss_fn):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), activation, nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return make_private(model, opt, (x, y), noise_multiplier=1.0, steps=10, batch_size=10,
                        verbose=False, loss_fn=loss_fn)


def _ce(o, t):
    return F.cross_entropy(o, t, reduction="none")


def _ce_smoothed(o, t):
    return F.cross_entropy(o, t, reduction="none", label_smoothing=0.5)


@pytest.mark.parametrize("other", ["activation", "loss", "loss-lambda"])
def test_a_resume_into_another_function_is_refused(other):
    """The same checkpoint resumed into a model with another activation (its state_dict still
    loads) or another loss continued the same secret noise on another function: the difference
    of the two releases was the noise-free difference of the clipped sums (residual 2e-5 against
    18 for independent noise)."""
    dp1 = _resume_setup(nn.ReLU(), _ce)
    ck = dp1.state_dict()
    if other == "activation":
        dp2 = _resume_setup(nn.Tanh(), _ce)
    elif other == "loss":
        dp2 = _resume_setup(nn.ReLU(), _ce_smoothed)
    else:
        dp2 = _resume_setup(nn.ReLU(), lambda o, t: F.cross_entropy(
            o, t, reduction="none", label_smoothing=0.5))
        dp1 = _resume_setup(nn.ReLU(), lambda o, t: F.cross_entropy(o, t, reduction="none"))
        ck = dp1.state_dict()
    with pytest.raises(ValueError, match="other settings"):
        dp2.load_state_dict(ck)
    same = _resume_setup(nn.ReLU(), _ce)
    same.load_state_dict(_resume_setup(nn.ReLU(), _ce).state_dict())  # the same: resumes


def test_an_interrupt_during_the_release_bookkeeping_lands_after_it_is_accounted(monkeypatch):
    """A Ctrl-C (SIGINT) arriving while dp.backward hands its release out: the loop guard had
    taken the gradients before the ledger recorded the event, so a KeyboardInterrupt in between
    left gradients optimizer.step() accepted and a ledger one step short. The release is now
    accounted first and no signal handler runs inside the bookkeeping: the interrupt is raised
    after it, the step counted."""
    import signal

    model, opt, dp = _setup()
    cls = type(dp.ledger)
    real = cls.record

    def record(self, event):
        signal.raise_signal(signal.SIGINT)  # (the handler runs after the bookkeeping)
        return real(self, event)

    monkeypatch.setattr(cls, "record", record)
    x, y = dp.sample()
    with pytest.raises(KeyboardInterrupt):
        dp.backward(x, y)
    monkeypatch.setattr(cls, "record", real)
    assert dp.steps == 1 and dp.ledger.steps == 1
    opt.step()  # the release is counted: applying it is allowed
    assert dp.epsilon() > 0


def test_a_warning_raised_as_an_error_after_the_step_leaves_the_release_accounted():
    """Ninety-first hostile review: with warnings turned into errors, the engine-fallback notice
    raised between dp_step's return and the ledger's record: dp.backward failed with the ledger
    at 0 steps, and the noisy release sat in _release's frame, reachable from the traceback. The
    release is now accounted (and its gradients handed to the loop) before anything can raise;
    the loop goes on."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Flatten(),
                          nn.Linear(12, 3))  # (auto falls back to vmap: a warning)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 10, (128, 3), generator=g)
    y = torch.randint(0, 3, (128,), generator=g)
    dp = make_private(model, None, (x, y), noise_multiplier=1.0, steps=10, batch_size=32,
                      engine="auto", verbose=False)
    xb, yb = dp.sample()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(Warning, match="ran on 'vmap'"):
            dp.backward(xb, yb)
    assert dp.ledger.steps == 1 and dp.steps == 1 and dp.epsilon() > 0
    xb, yb = dp.sample()  # (the release counted: the loop goes on)
    dp.backward(xb, yb)
    assert dp.ledger.steps == 2
