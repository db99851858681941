"""A fresh hostile review of the ghost engine's separability proof (issue 31, "Done when").

Each attack is a model or loss a user could pass to ``GhostEngine`` / ``engine="auto"``. LOO is
``max_j ||S(X) - S(X without j)|| / C`` of the noise-free clipped sum (``loo_distance``); a sound
per-example mechanism has LOO <= 1. Found and fixed here (each test failed on the code before):

* ``einsum('bi,ci->bi', h, ones_like(h))`` sums B ones into every row (the real-batch trace sees
  only public constants there): accepted, LOO 3.16 C; now refused by the batch-size proof;
* a user forward hook on a ghost-hooked layer (``o + k * o.mean(0)``): the engine read the
  gradient of the hook's mixed output as the layer's ``b``: accepted, LOO 1.06 C; now refused.

* a forward or loss that tells the symbolic-batch proof from the real run
  (``isinstance(x.shape[0], int)``, ``type(x) is torch.Tensor``, a call counter) and uses the batch
  size only in the real run: accepted, LOO 2.57-3.16 C; now the real run is matched operation by
  operation against what the proof ran (:mod:`dpclip.engine.proved_program`), and a step that
  differs is refused under ghost and auto alike (never a vmap fallback).

* second review: a value written into a named tensor by a path no operation shows (an in-place
  call with Python dispatch off, ``.numpy()`` of a constant, NumPy memory shared with an outside
  tensor): accepted, LOO 3.16 C; now refused (version counters and outside values in the match,
  writable escapes of any tensor in the tracer). Still open: a parameter or buffer sharing memory
  with a NumPy array (strict xfail).

The other attacks of the review are refused (regression tests below).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, VmapEngine
from dpclip.engine.batch import padded_rows
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import C, Net, ce, clipped_sum, data, loo_distance


class HookedHead(nn.Module):
    """A forward hook (registered at construction) that mixes a layer's output over the batch."""

    def __init__(self, k: float = 20.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.fc2.register_forward_hook(lambda m, i, o: o + k * o.mean(0))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Tied3(nn.Module):
    """One weight used by three calls of two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        return self.c(torch.tanh(self.a(h)))


class StaleBatchless(nn.Module):
    """A batch-less (1, 5) call whose input is a buffer written from the previous batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(5, 5), nn.Linear(5, 3)
        self.register_buffer("last", torch.zeros(1, 5))

    def forward(self, x: Tensor) -> Tensor:
        p = self.fc(self.last)
        with torch.no_grad():
            self.last.copy_(x.mean(0, keepdim=True))
        return self.head(torch.tanh(self.fc(x) + p))


def _no_grad_mean(h: Tensor) -> Tensor:
    with torch.no_grad():
        return h.mean(0)


def _in_place_shift(h: Tensor) -> Tensor:
    h2 = h.clone()
    h2[1:] += h2[:-1].clone()
    return h2


class _MixingScale(nn.Module):
    """A module without a ghost rule (the per-layer path) that centres its output over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(6))

    def forward(self, x: Tensor) -> Tensor:
        z = x * self.w
        return z - z.mean(0)


class _TwoLayers(nn.Module):
    """Linear -> ``mid`` -> tanh -> Linear, ``setup`` adds hooks to the second layer."""

    def __init__(self, mid: nn.Module | None = None, setup=None) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.mid = mid if mid is not None else nn.Identity()
        if setup is not None:
            setup(self.fc2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.mid(self.fc1(x))))


class _Centring(Tensor):
    """A ``__torch_function__`` subclass that centres every ``tanh`` over the batch."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.tanh, torch.tanh):
            out = out - out.mean(0)
        return out


def _checkpointed_tanh(h: Tensor) -> Tensor:
    from torch.utils.checkpoint import checkpoint
    return checkpoint(torch.tanh, h, use_reentrant=True)


def _mid(f):
    return lambda: Net(lambda m, h: f(h))


# name -> (model builder, loss); all refused by ghost
REFUSED = {
    "einsum-ones_like(B)": (_mid(lambda h: torch.einsum("bi,ci->bi", h, torch.ones_like(h))
                                 - 7 * h), ce),
    "einsum-ones_like-plain": (_mid(lambda h: torch.einsum("bi,ci->bi", h, torch.ones_like(h))),
                               ce),
    "forward-hook-mixes-output": (HookedHead, ce),
    "cumsum(0)": (_mid(lambda h: h.cumsum(0)), ce),
    "cummax(0)": (_mid(lambda h: h.cummax(0).values), ce),
    "logcumsumexp(0)": (_mid(lambda h: h.logcumsumexp(0)), ce),
    "sort(0)": (_mid(lambda h: h.sort(0).values), ce),
    "topk(0)": (_mid(lambda h: h.topk(h.shape[0], 0).values), ce),
    "kthvalue(0)": (_mid(lambda h: h - h.kthvalue(2, 0).values), ce),
    "median(0)": (_mid(lambda h: h - h.median(0).values), ce),
    "flat-shift": (_mid(lambda h: torch.cat([h.reshape(-1)[3:], h.reshape(-1)[:3]])
                        .reshape(h.shape)), ce),
    "pad-over-batch": (_mid(lambda h: nn.functional.pad(h.T, (1, 0))[:, :-1].T), ce),
    "avg_pool-over-batch": (_mid(lambda h: nn.functional.avg_pool1d(h.T.unsqueeze(0), 3, 1, 1)
                                 [0].T), ce),
    "conv-over-batch": (_mid(lambda h: nn.functional.conv1d(
        h.T.unsqueeze(1), torch.ones(1, 1, 3, dtype=h.dtype), padding=1)[:, 0].T), ce),
    "layer_norm-over-batch": (_mid(lambda h: nn.functional.layer_norm(h.T, (h.shape[0],)).T), ce),
    "gather-row0": (_mid(lambda h: h.gather(0, torch.zeros_like(h, dtype=torch.long))), ce),
    "index_select-flip": (_mid(lambda h: h.index_select(0, torch.arange(h.shape[0]).flip(0))),
                          ce),
    "index_put-flip": (_mid(lambda h: torch.zeros_like(h).index_put(
        (torch.arange(h.shape[0]).flip(0),), h)), ce),
    "scatter-flip": (_mid(lambda h: torch.zeros_like(h).scatter(
        0, torch.arange(h.shape[0]).flip(0)[:, None].expand_as(h), h)), ce),
    "where-with-flip": (_mid(lambda h: torch.where(h > 0, h, h.flip(0))), ce),
    "masked_scatter": (_mid(lambda h: h.masked_scatter(h > 0, h.flip(0))), ce),
    "unfold(0)": (_mid(lambda h: h.unfold(0, 2, 1).sum(-1).repeat(2, 1)[:h.shape[0]]), ce),
    "as_strided-overlap": (_mid(lambda h: h.contiguous().as_strided(h.shape, (1, 1))), ce),
    "fft(dim=0)": (_mid(lambda h: torch.fft.fft(h, dim=0).real), ce),
    "diff(dim=0)": (_mid(lambda h: torch.cat([h[:1], torch.diff(h, dim=0)])), ce),
    "complex-view-shift": (_mid(lambda h: torch.view_as_real(
        torch.view_as_complex(h.reshape(-1, 2)).reshape(-1)[1:].repeat(2)[:h.numel() // 2])
        .reshape(h.shape)), ce),
    "complex(h, flip)": (_mid(lambda h: torch.complex(h, h.flip(0)).real), ce),
    "transpose-view": (_mid(lambda h: h.T.contiguous().view(h.shape)), ce),
    "bmm-over-batch": (_mid(lambda h: torch.bmm(h.T.unsqueeze(0), torch.ones(
        1, h.shape[0], h.shape[0], dtype=h.dtype))[0].T), ce),
    "ones(1,B)@ones_like": (_mid(lambda h: h * (torch.ones(1, h.shape[0], dtype=h.dtype)
                                                @ torch.ones_like(h))), ce),
    "repeat_interleave": (_mid(lambda h: h.repeat_interleave(2, 0)[1:h.shape[0] + 1]), ce),
    "take-rolled": (_mid(lambda h: h.take(torch.arange(h.numel()).roll(1)).reshape(h.shape)), ce),
    "searchsorted-on-batch": (_mid(lambda h: h + torch.searchsorted(
        h[:, 0].contiguous().sort().values, h[:, :1].contiguous()).to(h.dtype)), ce),
    "normalize(dim=0)": (_mid(lambda h: nn.functional.normalize(h, dim=0)), ce),
    "std(0)": (_mid(lambda h: h / h.std(0)), ce),
    "cdist": (_mid(lambda h: torch.cdist(h, h)[:, :6]), ce),
    "h@(h.T@h)": (_mid(lambda h: h @ (h.T @ h) * 0.1), ce),
    "trapezoid(0)": (_mid(lambda h: h + torch.trapezoid(h, dim=0)), ce),
    "narrow-offset": (_mid(lambda h: torch.cat([h, h]).narrow(0, 1, h.shape[0])), ce),
    "chunk-swap": (_mid(lambda h: torch.cat(h.chunk(2, 0)[::-1])), ce),
    "unbind-reversed": (_mid(lambda h: torch.stack(list(h.unbind(0))[::-1])), ce),
    "sdpa-batch-as-sequence": (_mid(lambda h: nn.functional.scaled_dot_product_attention(
        h[None, None], h[None, None], h[None, None])[0, 0]), ce),
    "no_grad-island-mean": (_mid(lambda h: h - _no_grad_mean(h)), ce),
    "detach-mean": (_mid(lambda h: h + h.detach().mean(0)), ce),
    "in-place-shift": (_mid(_in_place_shift), ce),
    "stale-batchless-buffer": (StaleBatchless, ce),
    "per-layer-module-mixes": (lambda: _TwoLayers(_MixingScale()), ce),
    "backward-pre-hook": (lambda: _TwoLayers(setup=lambda m: m.register_full_backward_pre_hook(
        lambda mod, go: (go[0] + 5 * go[0].sum(0),))), ce),
    "forward-pre-hook-mixes-input": (lambda: _TwoLayers(setup=lambda m: m.register_forward_pre_hook(
        lambda mod, i: (i[0] - i[0].mean(0),))), ce),
    "reentrant-checkpoint": (_mid(_checkpointed_tanh), ce),
    "torch_function-subclass": (_mid(lambda h: torch.tanh(h.as_subclass(_Centring))
                                     .as_subclass(Tensor)), ce),
    "mean-loss-beside": (lambda: Net(), lambda o, y: ce(o, y) * 0
                         + nn.functional.cross_entropy(o, y)),
    "y.float().mean()": (lambda: Net(), lambda o, y: ce(o, y) * y.float().mean()),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_ghost_refuses(name):
    build, loss = REFUSED[name]
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = data()
    with pytest.raises(UnsupportedModelError):
        clipped_sum(GhostEngine(), model, loss, x, y)


@pytest.mark.parametrize("name", ["einsum-ones_like(B)", "forward-hook-mixes-output"])
def test_auto_runs_the_fixed_attacks_on_a_sound_path(name):
    build, loss = REFUSED[name]
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = data()
    _, info = clipped_sum(AutoEngine(), model, loss, x, y)
    assert info["engine"] == "vmap"
    assert loo_distance(AutoEngine(), model, loss, x, y) <= 1 + 1e-9


def test_a_weight_used_three_times_stays_within_c():
    """Tied parameters over three calls of two modules: accepted, LOO <= C."""
    torch.manual_seed(0)
    model = Tied3().to(DT)
    x, y = data()
    _, info = clipped_sum(GhostEngine(), model, ce, x, y)
    assert info["engine"] == "ghost"
    assert loo_distance(GhostEngine(), model, ce, x, y) <= 1 + 1e-9


def test_a_shared_dropout_mask_is_per_example_given_the_mask():
    """A (1, d) random mask expanded over the batch: each row is a function of its own example
    and of public randomness; with the randomness fixed, LOO <= C."""
    torch.manual_seed(0)
    model = Net(lambda m, h: h * torch.bernoulli(torch.full((1, 6), 0.5, dtype=h.dtype))
                .expand_as(h)).to(DT)
    x, y = data()

    def seeded(xs, ys):
        torch.manual_seed(123)
        return clipped_sum(GhostEngine(), model, ce, xs, ys)

    full, info = seeded(x, y)
    assert info["engine"] == "ghost"
    worst = max(float((full - seeded(x[[i for i in range(8) if i != j]],
                                     y[[i for i in range(8) if i != j]])[0]).norm())
                for j in range(8)) / 0.5
    assert worst <= 1 + 1e-9


# --------------------------------------------------- a program that tells the proof from the run
#
# The batch-size proof runs the forward on fake tensors with a symbolic batch size; user Python can
# tell them from real tensors and use the batch size only in the real run. Accepted before (LOO
# 2.57-3.16 C); now the real run is matched op by op against the proof's recording
# (dpclip.engine.proved_program) and a mismatch stops the step under ghost AND auto (no vmap
# fallback: whether a step matches can depend on the batch size).

_CALLS = {"n": 0}  # outside the model: the proof's cache key does not see it


def _real(t: Tensor) -> bool:
    return type(t) is torch.Tensor  # a FakeTensor in the proof


def _after_two_calls(h: Tensor) -> Tensor:
    _CALLS["n"] += 1  # the proof is call 1, the first real run call 2
    return h * h.shape[0] if _CALLS["n"] > 2 else h


DETECTING = {
    # h * (B - 7) in the real run: equal to the proof's h * 1 at B 8 only
    "fake-detection-forward": (_mid(lambda h: h * ((h.shape[0] - 7) if _real(h) else 1)), ce),
    "fake-detection-times-B": (_mid(lambda h: h * (h.shape[0] if _real(h) else 1)), ce),
    "symint-detection-loss": (lambda: Net(), lambda o, y: ce(o, y) * (
        (len(y) - 7) if isinstance(y.shape[0], int) else 1)),
    "fake-mode-detection": (_mid(lambda h: h / (
        1 if torch._guards.detect_fake_mode() is not None else h.shape[0])), ce),
    "literal-from-B": (_mid(lambda h: h * torch.tensor(
        float(h.shape[0]) if _real(h) else 1.0, dtype=h.dtype)), ce),
    "other-constant-in-real-run": (_mid(lambda h: h + (
        torch.full((6,), 1.0, dtype=h.dtype) if _real(h) else torch.zeros(6, dtype=h.dtype))), ce),
    "call-counter": (_mid(_after_two_calls), ce),
}


def _sums_or_refused(engine, model, loss, x, y) -> list:
    """The clipped sum at B 8 and at each of its eight B 7 neighbours (None: refused), two calls
    each (the second after the proof is cached)."""
    out = []
    for keep in [list(range(8))] + [[i for i in range(8) if i != j] for j in range(8)]:
        for _ in range(2):
            try:
                got, info = clipped_sum(engine, model, loss, x[keep], y[keep])
                assert info["engine"] == "ghost", info  # a mismatch is never a vmap fallback
            except UnsupportedModelError as exc:
                assert "program that the batch-size proof traced" in str(exc), str(exc)[:300]
                got = None
        out.append(got)
    return out


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
@pytest.mark.parametrize("name", list(DETECTING))
def test_a_program_that_detects_the_proof_never_exceeds_c(name, engine):
    """Every step either runs the proved program (LOO <= C between any two that ran) or is
    refused, and the attack is seen at one batch size at least."""
    from dpclip.engine import batch_symbol

    build, loss = DETECTING[name]
    torch.manual_seed(0)
    _CALLS["n"] = 0
    batch_symbol._CACHE.clear()
    model = build().to(DT)
    x, y = data()
    sums = _sums_or_refused(engine(), model, loss, x, y)
    assert any(s is None for s in sums), "the attack was not seen"
    if sums[0] is not None:
        for part in sums[1:]:
            if part is not None:
                assert float((sums[0] - part).norm()) / C <= 1 + 1e-9


def test_the_coinciding_size_runs_exactly_the_proved_program():
    """h * (rows - 31) in the real run equals the proof's h * 1 when the engine runs 32 rows
    (every chunk of 1 to 32 examples, padded to the row block: dpclip.engine.batch.padded_rows):
    that step is accepted and its clipped sum is the clean program's, bit for bit; at 33 examples
    (64 rows) it is refused, on ghost and on auto (whose public probe, padded to 32 rows too,
    coincides)."""
    torch.manual_seed(0)
    model = _mid(lambda h: h * ((h.shape[0] - (padded_rows(1) - 1)) if _real(h) else 1))().to(DT)
    clean = Net(lambda m, h: h * 1).to(DT)
    clean.load_state_dict(model.state_dict())
    x, y = data(b=33)
    got, _ = clipped_sum(GhostEngine(), model, ce, x[:8], y[:8])
    want, _ = clipped_sum(GhostEngine(), clean, ce, x[:8], y[:8])
    assert torch.equal(got, want)
    with pytest.raises(UnsupportedModelError, match="program that the batch-size proof traced"):
        clipped_sum(GhostEngine(), model, ce, x, y)
    with pytest.raises(UnsupportedModelError, match="program that the batch-size proof traced"):
        clipped_sum(AutoEngine(), model, ce, x, y)


class _Scaled(torch.Tensor):
    """A wrapper tensor whose __torch_dispatch__ multiplies every result by the realised batch
    size when it runs on real tensors (its Python runs below the dispatch modes)."""

    @staticmethod
    def __new__(cls, elem: Tensor) -> "_Scaled":
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem: Tensor) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        un = lambda a: a.elem if isinstance(a, _Scaled) else a  # noqa: E731
        out = func(*[un(a) for a in args], **{k: un(v) for k, v in (kwargs or {}).items()})
        first = next(a for a in args if isinstance(a, Tensor) and not isinstance(a, _Scaled))
        return out * first.shape[0] if _real(first) else out


def test_a_tensor_subclass_with_its_own_dispatch_is_not_proven():
    """h * scale with scale a subclass whose dispatch code uses the batch size on real tensors
    only: refused (auto runs vmap), never accepted by ghost. (This one also fails the export;
    the real-run tracer now refuses any argument with its own __torch_dispatch__ as well, for a
    subclass that survives the export: defence in depth.)"""
    torch.manual_seed(0)
    scale = _Scaled(torch.ones(6, dtype=DT))
    model = Net(lambda m, h: h * scale).to(DT)
    x, y = data()
    with pytest.raises(UnsupportedModelError, match="tensor subclass|program that the batch"):
        clipped_sum(GhostEngine(), model, ce, x, y)


def test_error_85_names_the_fix():
    """docs/errors.md entry 85: the message says why there is no fallback and what to do."""
    build, loss = DETECTING["fake-detection-times-B"]
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = data()
    with pytest.raises(UnsupportedModelError) as err:
        clipped_sum(AutoEngine(), model, loss, x, y)
    msg = str(err.value)
    assert "does not run the program that the batch-size proof traced" in msg
    assert "not turned into a vmap fallback" in msg and "engine 'vmap'" in msg
    assert "8" not in msg.replace("of the proof's 8 operations", "")  # no batch size quoted


@pytest.mark.parametrize("b", [2, 3, 5, 8, 13])
def test_an_ordinary_model_matches_its_proof_at_every_batch_size(b):
    """The recorded program is a function of the symbolic batch size: an honest model (dropout,
    a literal tensor, views sized by the batch, a batch-first arange position) matches at every
    size without a new proof."""

    class Honest(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
            self.drop = nn.Dropout(0.1)

        def forward(self, x: Tensor) -> Tensor:
            h = self.drop(self.fc1(x)) * torch.tensor(0.5, dtype=x.dtype)
            h = h.view(x.shape[0], 2, 3).reshape(x.size(0), -1)
            return self.fc2(torch.tanh(h))

    torch.manual_seed(0)
    model = Honest().to(DT)
    x, y = data(b)
    _, info = clipped_sum(GhostEngine(), model, ce, x, y)
    assert info["engine"] == "ghost"


class _GlobalIds(nn.Module):
    """A batch-less call on ids kept in a Python global, rewritten from the batch in forward: the
    batch-size proof runs the forward on fake tensors, so the global then holds a fake tensor of
    the proof, and the real run is not the program that was proved."""

    store: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(7, 4)
        self.pos = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        out = self.head((self.tok(x) + self.pos(self.store["ids"])).mean(1))
        self.store["ids"] = (x[:1] % 7).detach()
        return out


def test_state_written_during_the_proof_is_refused_not_a_crash():
    """It crashed the step with a raw GuardOnDataDependentSymNode (hostile review): now every
    step is refused as not proven, with a message naming the layer."""
    torch.manual_seed(0)
    _GlobalIds.store = {"ids": torch.zeros(1, 3, dtype=torch.long)}
    model = _GlobalIds().to(DT)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 7, (8, 3), generator=g), torch.randint(0, 3, (8,), generator=g)
    from dpclip.engine import ParamGroups

    for _ in range(2):
        with pytest.raises(UnsupportedModelError, match="left over from the separability proof|"
                                                         "mixes the examples"):
            GhostEngine().compute(model, ce, x, y, lambda n: (0.5 / n).clamp(max=1.0),
                                  ParamGroups.flat(model))


_CARRY: list = []
_USE_CARRY = {"on": False}  # outside the model: the proof's cache key does not see it


class _AbortCarry(nn.Module):
    """Carries a copy of its batch out of the call (a module-level list), and reads it in a later
    call only when the module-level switch is on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        out = h + 7 * _CARRY[-1].mean(0) if _USE_CARRY["on"] and _CARRY else h
        _CARRY.append(h.detach().clone())
        return self.fc2(torch.tanh(out))


def test_data_carried_out_of_a_refused_call_is_a_past_batch():
    """A call refused half-way (here by a user forward hook on fc2, after the batch was carried
    out) used to leave the carried copy unremembered: the next call read it as a constant and ghost
    accepted a sum in which every example moved with the last batch. Now an aborted trace is
    retired like a finished one, and the next call is refused."""
    from dpclip.engine import ParamGroups

    torch.manual_seed(0)
    _CARRY.clear()
    _USE_CARRY["on"] = False
    model = _AbortCarry().to(DT)
    x, y = data()
    weights = lambda n: (0.5 / n).clamp(max=1.0)  # noqa: E731
    handle = model.fc2.register_forward_hook(lambda m, i, o: o)
    with pytest.raises(UnsupportedModelError, match="forward hook"):
        GhostEngine().compute(model, ce, x, y, weights, ParamGroups.flat(model))
    handle.remove()
    _USE_CARRY["on"] = True  # the proof is cached: the real run reads the last real batch's copy
    x2, y2 = data(seed=1)
    try:
        # refused as a past batch's data, or (since the match against the proved program) because
        # the proof, cached from the first call, did not read the carried copy at all, or (since
        # hooks are part of the proof's key: the hook's removal gets a proof of its own, whose
        # run leaves a copy) as a tensor left over from the proof
        with pytest.raises(UnsupportedModelError, match="mixes|depends on several|program that "
                           "the batch-size proof traced|left over from the separability proof"):
            GhostEngine().compute(model, ce, x2, y2, weights, ParamGroups.flat(model))
    finally:
        _CARRY.clear()
        _USE_CARRY["on"] = False


# ------------------------------------------ writes that neither the trace nor the match can see
#
# Second hostile review (after the proved-program match): the match names tensors (an outside
# tensor by identity, a parameter or buffer by name, an activation by the operation that made it)
# but did not check that their VALUES are still those the name stands for. A program that tells
# the proof from the run writes ``B - 7`` into a tensor in the real run only, by a path that no
# recorded operation shows: NumPy (raw memory), or an in-place ATen call with Python dispatch (and
# torch functions) switched off. Every step matched and ran: LOO 3.16 C at B 8 (C 0.5, float64).

import numpy as np  # noqa: E402

_G = torch.ones(6, dtype=DT)  # an outside tensor: named by identity in the proof and the run
_G_NP = np.ones(6)  # a NumPy array whose memory a buffer shares (torch.from_numpy)


def _numpy_write_global(m, h: Tensor) -> Tensor:
    if _real(h):
        _G.numpy()[:] = h.shape[0] - 7
    return h * _G


def _no_dispatch_fill_global(m, h: Tensor) -> Tensor:
    if _real(h):
        with torch._C._DisableTorchDispatch():
            _G.fill_(h.shape[0] - 7)
    return h * _G


def _no_modes_scale_activation(m, h: Tensor) -> Tensor:
    from torch.utils._python_dispatch import _disable_current_modes

    h2 = h * 1.0
    if _real(h2):
        with _disable_current_modes():
            h2.mul_(h.shape[0] - 7)
    return h2


def _no_python_scale_activation(m, h: Tensor) -> Tensor:
    h2 = h * 1.0
    if _real(h2):
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            h2.mul_(h.shape[0] - 7)
    return h2


_G_NP2 = np.ones(6)
_G2 = torch.from_numpy(_G_NP2)  # an outside tensor sharing a NumPy array's memory


def _numpy_shared_global(m, h: Tensor) -> Tensor:
    if _real(h):
        _G_NP2[:] = h.shape[0] - 7  # no torch call at all
    return h * _G2


def _hidden_write_then_matched_write(m, h: Tensor) -> Tensor:
    """A hidden write, then a matched write to a view made before it: the matched write must not
    absorb the hidden one (the counter moved twice)."""
    h2 = h * 1.0
    v = h2[:, :3]
    if _real(h2):
        with torch._C._DisableTorchDispatch():
            h2.mul_(h.shape[0] - 7)
    v.add_(0.0)
    return h2


class _BufferWrite(Net):
    """A buffer written through NumPy (``via``: its ``.numpy()`` view, or a NumPy array whose
    memory it shares from construction)."""

    def __init__(self, via: str) -> None:
        super().__init__(lambda m, h: self._scale(h))
        self.via = via
        self.register_buffer("k", torch.from_numpy(_G_NP) if via == "shared" else
                             torch.ones(6, dtype=DT))

    def _scale(self, h: Tensor) -> Tensor:
        if _real(h):
            (_G_NP if self.via == "shared" else self.k.numpy())[:] = h.shape[0] - 7
        return h * self.k


_G_NP3 = np.ones(6)  # shared with a parameter
_G_NP4 = np.ones((2, 6))  # shared with an embedding table
_G_NP5 = np.ones(6)  # shared with a constant made in the call


class _ParameterShared(Net):
    """A trainable parameter made with ``torch.from_numpy``: written through the array."""

    def __init__(self) -> None:
        super().__init__(lambda m, h: self._scale(h))
        self.k = nn.Parameter(torch.from_numpy(_G_NP3))

    def _scale(self, h: Tensor) -> Tensor:
        if _real(h):
            _G_NP3[:] = h.shape[0] - 7
        return h * self.k


class _ViewKept(Net):
    """A buffer whose ``.numpy()`` view was taken at construction (outside any call)."""

    def __init__(self) -> None:
        super().__init__(lambda m, h: self._scale(h))
        self.register_buffer("k", torch.ones(6, dtype=DT))
        self.__dict__["k_np"] = self.k.numpy()  # (a plain attribute, not a module state)

    def _scale(self, h: Tensor) -> Tensor:
        if _real(h):
            self.k_np[:] = h.shape[0] - 7
        return h * self.k


class _BatchlessTable(Net):
    """An embedding looked up without the batch dimension (the engine expands it), its table
    shared with NumPy."""

    def __init__(self) -> None:
        super().__init__(lambda m, h: self._scale(h))
        self.emb = nn.Embedding(2, 6)
        self.emb.weight = nn.Parameter(torch.from_numpy(_G_NP4))

    def _scale(self, h: Tensor) -> Tensor:
        if _real(h):
            _G_NP4[:] = h.shape[0] - 7
        return h * self.emb(torch.zeros(1, dtype=torch.long))


class _WriteAfterLastUse(Net):
    """The forward reads the buffer with its honest value; the write comes after its last use,
    before the backward reads it (the gradient of ``h * k`` with respect to ``h`` is ``k``)."""

    def __init__(self) -> None:
        super().__init__(lambda m, h: self._scale(h))
        self.register_buffer("k", torch.from_numpy(_G_NP))

    def _scale(self, h: Tensor) -> Tensor:
        out = h * self.k
        if _real(h):
            _G_NP[:] = h.shape[0] - 7
        return out


def _constant_written_after_use(m, h: Tensor) -> Tensor:
    """A constant made in the call from a NumPy array (shared memory), written after its use."""
    c = torch.from_numpy(_G_NP5)
    out = h * c
    if _real(h):
        _G_NP5[:] = h.shape[0] - 7
    return out


class _StorageKept(Net):
    """A buffer's untyped storage kept at construction, written in forward with Python dispatch
    and torch functions off (no operation, no version bump): LOO 3.19 C under ghost with the
    memory watch switched off."""

    def __init__(self) -> None:
        super().__init__(lambda m, h: self._scale(h))
        self.register_buffer("k", torch.ones(6, dtype=DT))
        self.__dict__["k_storage"] = self.k.untyped_storage()

    def _scale(self, h: Tensor) -> Tensor:
        if _real(h):
            new = torch.full((6,), float(h.shape[0] - 7), dtype=DT)
            with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
                self.k_storage.copy_(new.untyped_storage())
        return h * self.k


class _MovedBuffer(Net):
    """A buffer moved to other memory holding ``B - 7`` with no operation the match sees:
    ``k.data = new`` (with torch functions on or off), or ``k.set_(new)`` with Python dispatch
    off."""

    def __init__(self, how: str) -> None:
        super().__init__(lambda m, h: self._scale(h))
        self.how = how
        self.register_buffer("k", torch.ones(6, dtype=DT))

    def _scale(self, h: Tensor) -> Tensor:
        if _real(h):
            new = torch.full((6,), float(h.shape[0] - 7), dtype=DT)
            if self.how == "data":
                self.k.data = new
            elif self.how == "data-no-torch-function":
                with torch._C.DisableTorchFunction():
                    self.k.data = new
            else:
                with torch._C._DisableTorchDispatch():
                    self.k.set_(new)
        return h * self.k


UNSEEN_WRITES = {
    "numpy-write-outside-tensor": lambda: Net(_numpy_write_global),
    "no-dispatch-fill-outside-tensor": lambda: Net(_no_dispatch_fill_global),
    "no-modes-inplace-activation": lambda: Net(_no_modes_scale_activation),
    "no-python-inplace-activation": lambda: Net(_no_python_scale_activation),
    "numpy-write-buffer": lambda: _BufferWrite("numpy"),
    "numpy-shared-outside-tensor": lambda: Net(_numpy_shared_global),
    "hidden-write-then-matched-write": lambda: Net(_hidden_write_then_matched_write),
    "numpy-shared-buffer": lambda: _BufferWrite("shared"),
    "numpy-shared-parameter": _ParameterShared,
    "numpy-view-from-construction": _ViewKept,
    "numpy-shared-batchless-table": _BatchlessTable,
    "numpy-write-after-last-use": _WriteAfterLastUse,
    "from-numpy-constant-written-after-use": lambda: Net(_constant_written_after_use),
    "storage-kept-at-construction": _StorageKept,
    "data-assignment-buffer": lambda: _MovedBuffer("data"),
    "data-assignment-torch-function-off": lambda: _MovedBuffer("data-no-torch-function"),
    "set-storage-dispatch-off": lambda: _MovedBuffer("set"),
}


def reset_unseen() -> None:
    """The shared arrays and the proof cache as a fresh process has them (the attacks write)."""
    from dpclip.engine import batch_symbol

    batch_symbol._CACHE.clear()
    _G.fill_(1.0)
    for a in (_G_NP, _G_NP2, _G_NP3, _G_NP4, _G_NP5, _G_NP6):
        a[...] = 1.0


#: still open: the write is accepted (strict xfail; the LOO measured is in the reason)
_OPEN: dict[str, str] = {}


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_OPEN[n])) if n in _OPEN else n
    for n in UNSEEN_WRITES])
def test_a_value_written_outside_the_trace_never_exceeds_c(name, engine):
    """Refused, or LOO <= C."""
    reset_unseen()
    torch.manual_seed(0)
    model = UNSEEN_WRITES[name]().to(DT)
    x, y = data()
    try:  # a refusal at B 8 or at any of its B 7 neighbours stops that run
        assert loo_distance(engine(), model, ce, x, y) <= 1 + 1e-9
    except UnsupportedModelError:
        pass


_G_NP6 = np.ones((6, 5))  # shared with the first weight of a chain of torch.nn modules


def chain_shared_with_numpy() -> nn.Module:
    """A chain of known modules whose first weight shares ``_G_NP6``'s memory."""
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    model[0].weight = nn.Parameter(torch.from_numpy(_G_NP6))
    return model


def _loss_writes_chain_weight(o: Tensor, y: Tensor) -> Tensor:
    """The forward is a chain of known modules (run by the engine, no user code); the loss, user
    code, writes the first layer's weight before the backward reads it."""
    if _real(o):
        _G_NP6[:] = o.shape[0] - 7
    return ce(o, y)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_chain_weight_written_by_the_loss_never_exceeds_c(engine):
    """Refused (before the watch: accepted, LOO 4.00 C): the known-chain path matches the loss
    only, and the memory watch starts there."""
    reset_unseen()
    torch.manual_seed(0)
    model = chain_shared_with_numpy()
    x, y = data()
    try:
        assert loo_distance(engine(), model, _loss_writes_chain_weight, x, y) <= 1 + 1e-9
    except UnsupportedModelError as exc:
        assert "memory of parameter '0.weight'" in str(exc)


def test_state_shared_with_numpy_and_not_written_still_runs_on_ghost():
    """The watch must not refuse honest sharing: weights loaded with ``torch.from_numpy`` (and a
    buffer counter written by an operation the match accepts) run on ghost, equal to the float64
    per-example loop."""
    from dpclip.engine import NaiveEngine, batch_symbol

    class Loaded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            rng = np.random.default_rng(0)
            self.fc1 = nn.Linear(5, 6).to(DT)
            self.fc1.weight = nn.Parameter(torch.from_numpy(rng.normal(size=(6, 5))))
            self.register_buffer("scale", torch.from_numpy(np.full(6, 0.5)))
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))
            self.fc2 = nn.Linear(6, 3).to(DT)

        def forward(self, x: Tensor) -> Tensor:
            self.calls.add_(1)
            return self.fc2(torch.tanh(self.fc1(x) * self.scale))

    batch_symbol._CACHE.clear()
    torch.manual_seed(0)
    model = Loaded()
    x, y = data()
    got, info = clipped_sum(GhostEngine(), model, ce, x, y)
    want, _ = clipped_sum(NaiveEngine(), model, ce, x, y)  # the float64 per-example loop
    assert info["engine"] == "ghost"
    assert torch.allclose(got, want, atol=1e-10, rtol=1e-8)


def test_honest_in_place_writes_still_match_their_proof():
    """The version check of the match (a tensor written by no matched operation loses its name)
    must not refuse honest writes: in-place on a view, on the whole tensor, batch norm's running
    statistics in eval mode (read), a buffer counter (written)."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.bn, self.fc2 = nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)
            self.bn.eval()
            self.register_buffer("count", torch.zeros((), dtype=torch.long))

        def forward(self, x: Tensor) -> Tensor:
            h = self.fc1(x) * 1.0
            v = h[:, :3]
            v.mul_(2.0)
            h.add_(1.0)
            h[:, 4:].mul_(0.5)
            self.count.add_(1)
            h = torch.relu_(self.bn(h))
            return self.fc2(h + v.sum(1, keepdim=True))

    torch.manual_seed(0)
    model = InPlace().to(DT)
    x, y = data()
    for _ in range(2):
        _, info = clipped_sum(GhostEngine(), model, ce, x, y)
        assert info["engine"] == "ghost"


# ---------------------------------- state the match did not compare: custom kernels, generators

_STATE = {"k": 1.0}


@torch.library.custom_op("dpclip_hostile_review::scale", mutates_args=())
def _scale(t: Tensor) -> Tensor:
    """A custom operation whose real kernel reads Python state (the proof runs its fake)."""
    return t * _STATE["k"]


@_scale.register_fake
def _(t: Tensor) -> Tensor:
    return torch.empty_like(t)


def _custom_kernel_reads_state(m, h: Tensor) -> Tensor:
    if _real(h):
        _STATE["k"] = float(h.shape[0] - 7)
    return h * _scale(torch.ones(6, dtype=h.dtype))  # on a constant: the tracer sees a constant


_GEN = torch.Generator()


def _reseed_default(m, h: Tensor) -> Tensor:
    if _real(h):
        torch.manual_seed(h.shape[0])
    return h * torch.bernoulli(torch.full((1, 6), 0.5, dtype=h.dtype)).expand_as(h) * 2


def _reseed_generator(m, h: Tensor) -> Tensor:
    if _real(h):
        _GEN.set_state(torch.Generator().manual_seed(h.shape[0]).get_state())
    return h * torch.bernoulli(torch.full((1, 6), 0.5, dtype=h.dtype),
                               generator=_GEN).expand_as(h) * 2


HIDDEN_STATE = {
    # accepted before: LOO 3.16 C
    "custom-op-kernel-reads-state": _custom_kernel_reads_state,
    # accepted before: LOO 3.83 C with every generator seeded (123) before each call: the dropout
    # masks were a function of the private batch size
    "manual_seed(len(x))-before-dropout": _reseed_default,
    "generator-state-from-len(x)": _reseed_generator,
}


@pytest.mark.parametrize("name", list(HIDDEN_STATE))
def test_hidden_state_in_the_real_run_never_exceeds_c(name):
    """Refused, or LOO <= C with the randomness fixed outside the call (as
    test_a_shared_dropout_mask_is_per_example_given_the_mask)."""
    from dpclip.engine import batch_symbol

    batch_symbol._CACHE.clear()
    _STATE["k"] = 1.0
    torch.manual_seed(0)
    model = Net(HIDDEN_STATE[name]).to(DT)
    x, y = data()

    def seeded(xs, ys):
        torch.manual_seed(123)
        _GEN.manual_seed(123)
        return clipped_sum(GhostEngine(), model, ce, xs, ys)[0]

    try:
        full = seeded(x, y)
        worst = max(float((full - seeded(x[[i for i in range(8) if i != j]],
                                         y[[i for i in range(8) if i != j]])).norm())
                    for j in range(8)) / C
    except UnsupportedModelError as exc:
        assert "program that the batch-size proof traced" in str(exc)
        return
    assert worst <= 1 + 1e-9


def test_an_overridden_aten_kernel_never_exceeds_c():
    """The match names the operation ``aten::frac``, not the kernel that runs: a Python CPU
    kernel registered over it (``torch.library.Library('aten', 'IMPL')``) returns a global set
    from ``len(x)`` in the real run. Accepted before (LOO 3.16 C); now refused (torch.library's
    ledger of Python kernels is read before each operation)."""
    import warnings

    from dpclip.engine import batch_symbol

    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            lib.impl("frac", lambda t: torch.full_like(t, _STATE["k"]), "CPU")

        def attack(m, h: Tensor) -> Tensor:
            if _real(h):
                _STATE["k"] = float(h.shape[0] - 7)
            return h * torch.frac(torch.ones(6, dtype=h.dtype))

        batch_symbol._CACHE.clear()
        torch.manual_seed(0)
        model = Net(attack).to(DT)
        x, y = data()
        try:
            assert loo_distance(GhostEngine(), model, ce, x, y) <= 1 + 1e-9
        except UnsupportedModelError as exc:
            assert "kernel registered from Python" in str(exc)
    finally:
        lib._destroy()
        _STATE["k"] = 1.0


def test_a_patched_known_module_class_is_traced_not_trusted():
    """``nn.Tanh.forward`` patched on the class (no instance forward, exact type): the chain of
    known modules ran it untraced as torch's Tanh, and ghost accepted a forward centring over the
    batch (LOO 3.14 C). Now a known class whose forward is not torch's own is traced: refused."""
    original = nn.Tanh.forward
    nn.Tanh.forward = lambda self, x: torch.tanh(x + 3 * x.mean(0))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
        x, y = data()
        try:
            assert loo_distance(GhostEngine(), model, ce, x, y) <= 1 + 1e-9
        except UnsupportedModelError as exc:
            assert "mixes the examples" in str(exc)
    finally:
        nn.Tanh.forward = original



# ============================================================================== third review
#
# A third hostile review (after the proved-program match): ways to make a call run user code that
# the proof does not see, while ghost / auto accept the model. Each entry: a model (built with
# the switch ``_SW`` off), its data and loss, and a context active around the step. The runner
# makes the LOO's calls with the switch off (they fill the proof's cache and the chain layout
# cache, as honest steps at these batch sizes would), turns it on, and measures LOO. Fixed here
# (LOO at C 0.5 before the fix, on main 8a83764; benchmarks/results/hostile_review_loo.md, rows
# "third: ...", max over six C):
#
# * known chain (``ghost_forward._known_chain``) and layout cache (``_chain_key``): a module whose
#   call runs user code: ``Softmax(dim=int subclass)`` lying to the check (1.10), BatchNorm's
#   ``training`` an object whose ``__bool__`` lies to the engine (1.57), a parameter subclass with
#   ``__torch_function__`` (2.00), a hook table that is a dict subclass hiding its hooks (1.80), an
#   instance ``_conv_forward`` (2.46) or ``_compiled_call_impl`` (2.00), a hook on a
#   parameter-free module of a cached chain (1.80), a user class naming its ``__module__`` torch's
#   (1.80), a tensor subclass as the input (2.00); now: plain instances only
#   (dpclip.engine.plain_module); a hooked layer's forward hook table whose ``values()`` hides a
#   user hook from the engine's check (1.06): now exact tables only;
# * a known loss whose configuration is a ``str`` subclass (``reduction``) running user code that
#   rewrites the logits in place (1.04): now plain instances only;
# * a torch function mode left active around the step (2.94), saved-tensor hooks left active
#   (1.55, the known program): now refused at the step;
# * an instance ``forward`` on a ruled layer, static (2.00) or installed for the call and deleted
#   by itself (2.00), or deleted by a user pre-hook after Module.__call__ looked it up (2.00), a
#   class swapped for the call (2.00), a subclass keeping ``forward`` whose ``__getattribute__``
#   hands the call another one (2.00): now the per-layer path (static) or refused at the call
#   (the engine's pre-hook runs first);
# * a ruled layer's input rewritten after the call with Python dispatch off and the version counter
#   set back (1.54), a per-layer module's kept argument (1.57) or recognised scale's operand
#   (1.56) rewritten so, a ruled layer's weight rewritten so for its call and restored after
#   it (2.13): now their bytes are fingerprinted (dpclip.engine.saved_check; the weights when
#   the step starts, checked right after each call);
# * a dispatch mode entered by the loss and not left, so that the engine's backward runs under it:
#   refused after the forward (regression test: on 8a83764 the leaked mode traded places with the
#   tracer's on its exit and the LOO stayed 1.0; with the check at the step's start alone, auto
#   ran the next steps on vmap under the leaked modes, LOO 3.73).

import collections  # noqa: E402
import contextlib  # noqa: E402
import sys  # noqa: E402

from torch.overrides import TorchFunctionMode  # noqa: E402

from dpclip.engine import ghost_forward  # noqa: E402

_SW = {"on": False}  # outside the model: the proof's cache key does not see it


def _mix(o: Tensor) -> Tensor:
    return o + 5 * o.mean(0) if _SW["on"] else o


def _called_by_dpclip(depth: int = 2) -> bool:
    """Whether the caller of the caller is the engine's code (a hostile object answers it
    differently from torch's)."""
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("dpclip.")


class _LyingInt(int):
    def __mod__(self, other):
        return 1  # Softmax(dim=0): the check reads dim % ndim == 1, the forward reads 0


class _LyingFlag:
    def __bool__(self) -> bool:
        return not _called_by_dpclip()  # eval for the engine, training (batch stats) for torch


class _HidingHooks(dict):
    def __bool__(self) -> bool:
        return len(self) > 0 and not _called_by_dpclip()


class _ValuesHidingHooks(collections.OrderedDict):
    def values(self):  # Module.__call__ reads items()
        return iter(())


def _forward_hook_hidden_from_values() -> nn.Module:
    m = _TwoLayers()
    m.fc2._forward_hooks = _ValuesHidingHooks()
    m.fc2.register_forward_hook(lambda mod, i, o: o + 20 * o.mean(0))
    return m


class _MixingParam(nn.Parameter):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is nn.functional.linear:
            out = out + 5 * out.mean(0)
        return out


class _MixingInput(Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is nn.functional.linear and isinstance(out, Tensor):
            out = out.as_subclass(Tensor)
            out = out + 5 * out.mean(0)
        return out


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _softmax_lying_dim() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.Softmax(dim=_LyingInt(0)), nn.Linear(6, 3))


def _batchnorm_lying_training() -> nn.Module:
    m = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).eval()
    m[1].training = _LyingFlag()
    return m


def _parameter_subclass() -> nn.Module:
    m = _mlp()
    m[0].weight = _MixingParam(m[0].weight.detach())
    return m


def _hidden_hook_table() -> nn.Module:
    m = _mlp()
    m[1]._forward_hooks = _HidingHooks()
    m[1].register_forward_hook(lambda mod, i, o: o + 5 * o.mean(0))
    return m


def _conv_mlp(cached: bool) -> nn.Module:
    layers = [nn.Conv1d(1, 2, 3, padding=1)] + ([nn.Hardshrink(0.0)] if cached else []) + [
        nn.Flatten(), nn.Linear(10, 3)]
    m = nn.Sequential(*layers)
    c = m[0]
    c._conv_forward = lambda x, w, b: _mix(nn.functional.conv1d(x, w, b, padding=1)) if cached \
        else (lambda o: o + 5 * o.mean(0))(nn.functional.conv1d(x, w, b, padding=1))
    return m


def _compiled_call_impl() -> nn.Module:
    """``Module._wrapped_call_impl`` calls an instance ``_compiled_call_impl`` in place of
    ``_call_impl`` (what ``Module.compile`` sets)."""
    m = _mlp()
    f = m[0]
    f._compiled_call_impl = lambda x: (lambda o: o + 5 * o.mean(0))(
        nn.functional.linear(x, f.weight, f.bias))
    return m


def _hook_on_parameter_free_module() -> nn.Module:
    m = _mlp()
    m[1].register_forward_hook(lambda mod, i, o: _mix(o))
    return m


class _TorchLooking(nn.Module):
    """A user module whose class claims to be torch's (``__module__``)."""

    def forward(self, x: Tensor) -> Tensor:
        return _mix(torch.tanh(x))


_TorchLooking.__module__ = "torch.nn.modules.activation"


def _instance_forward_static() -> nn.Module:
    m = Net()
    f = m.fc1
    f.forward = lambda x: (lambda o: o + 5 * o.mean(0))(nn.functional.linear(x, f.weight, f.bias))
    return m


class _InstallForward(nn.Module):
    """Installs an instance forward on a ruled layer for the call; it deletes itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        f = self.fc1

        def fwd(z: Tensor) -> Tensor:
            del f.forward
            o = nn.functional.linear(z, f.weight, f.bias)
            return o + 5 * o.mean(0)

        f.forward = fwd
        return self.fc2(torch.tanh(f(x)))


class _MixingLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        o = nn.functional.linear(x, self.weight, self.bias)
        return o + 5 * o.mean(0)


class _LookupLinear(nn.Linear):
    """Keeps ``nn.Linear.forward`` as its class attribute, but its ``__getattribute__`` hands
    ``Module.__call__`` another forward."""

    def __getattribute__(self, name: str):
        if name == "forward":
            return super().__getattribute__("_mixing")
        return super().__getattribute__(name)

    def _mixing(self, x: Tensor) -> Tensor:
        o = nn.functional.linear(x, self.weight, self.bias)
        return o + 5 * o.mean(0)


def _lookup_model() -> nn.Module:
    m = _TwoLayers()
    m.fc1 = _LookupLinear(5, 6)
    return m


class _SwapClass(nn.Module):
    """Gives a ruled layer a mixing class for its call, and its own class back after it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        self.fc1.__class__ = _MixingLinear
        h = self.fc1(x)
        self.fc1.__class__ = nn.Linear
        return self.fc2(torch.tanh(h))


class _PreHookDeletesForward(_InstallForward):
    """An instance forward installed for the call, deleted by a user pre-hook of the layer (after
    ``Module.__call__`` looked it up, before a check in a later pre-hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1.register_forward_pre_hook(lambda m, i: m.__dict__.pop("forward", None) and None)

    def forward(self, x: Tensor) -> Tensor:
        f = self.fc1
        f.forward = lambda z: (lambda o: o + 5 * o.mean(0))(
            nn.functional.linear(z, f.weight, f.bias))
        return self.fc2(torch.tanh(f(x)))


def _hidden_write(t: Tensor) -> None:
    """``t += 5 t.mean(0)`` that no trace sees, its version counter set back."""
    version = t._version
    with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        t.add_(5 * t.mean(0))
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


class _RewriteKeptInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        a = torch.tanh(self.fc1(x))
        o = self.fc2(a)
        if _SW["on"]:
            _hidden_write(a)  # after fc2 used it: the engine reads it after the backward
        return o


class _Scale(nn.Module):
    """No ghost rule (the per-layer path): a recognised elementwise scale (``fast``: its operand is
    kept) or a general function of its input (its argument is kept for the recomputation)."""

    def __init__(self, fast: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(6))
        self.fast = fast

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w if self.fast else torch.sin(x * self.w)


class _RewritePerLayerArgument(nn.Module):
    def __init__(self, fast: bool) -> None:
        super().__init__()
        self.fc1, self.s, self.fc2 = nn.Linear(5, 6), _Scale(fast), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        o = self.fc2(torch.tanh(self.s(h)))
        if _SW["on"]:
            _hidden_write(h)  # the per-layer path reads it after the backward
        return o


class _RewriteWeightForTheCall(nn.Module):
    """Writes the batch mean into fc1's weight for its call, without a trace, and restores it
    after the call (every name, the match and the state guard then see the original)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        w = self.fc1.weight
        if not _SW["on"]:
            return self.fc2(torch.tanh(self.fc1(x)))
        version = w._version
        with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            saved = w.clone()
            w.add_(x.mean(0).expand_as(w) * 0.5)
        torch._C._autograd._unsafe_set_version_counter((w,), (version,))
        h = self.fc1(x)
        with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            w.copy_(saved)
        torch._C._autograd._unsafe_set_version_counter((w,), (version,))
        return self.fc2(torch.tanh(h))


class _RewriteAutogradSaved(nn.Module):
    """Rewrites a tensor autograd saved (exp's result), not one the engine keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        u = torch.exp(self.fc1(x) * 0.1)
        o = self.fc2(torch.tanh(u))
        if _SW["on"]:
            _hidden_write(u)
        return o


def _grad_hook_without_torch_function(m, h: Tensor) -> Tensor:
    with torch._C.DisableTorchFunction():  # the tracer's mode does not see register_hook
        if h.requires_grad and _SW["on"]:
            h.register_hook(lambda g: g + 5 * g.mean(0))
    return h


_LAST: dict = {}


class _ReadsLastBatchUnderVmap(nn.Module):
    """No ghost rule (the per-layer path). Keeps the real batch in a global; its per-example
    recomputation under ``torch.func.vmap`` (after the traced call) reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(6))

    def forward(self, x: Tensor) -> Tensor:
        if torch._C._functorch.is_functorch_wrapped_tensor(x):
            return torch.sin(x * self.w) + 5 * _LAST["x"].mean(0) * self.w
        _LAST["x"] = x
        return torch.sin(x * self.w) + 0 * self.w


def _per_layer_global() -> nn.Module:
    return _TwoLayers(_ReadsLastBatchUnderVmap())


class _LyingStr(str):
    """``reduction='none'`` whose comparison, when torch makes it, rewrites the logits."""

    def __eq__(self, other):
        if not _called_by_dpclip():
            f = sys._getframe(1)
            while f is not None and "input" not in f.f_locals:
                f = f.f_back
            h = f.f_locals["input"] if f is not None else None
            if isinstance(h, Tensor) and h.ndim == 2 and h.requires_grad:
                _hidden_write(h)
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def _lying_ce() -> nn.Module:
    loss = nn.CrossEntropyLoss(reduction="none")
    loss.reduction = _LyingStr("none")
    return loss


class _CentreMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _SW["on"] and func is nn.functional.linear and isinstance(out, Tensor):
            out = out + 5 * out.mean(0)
        return out


_LEAKED: list = []


class _MixBackward(torch.utils._python_dispatch.TorchDispatchMode):
    """Mixes tanh's backward over the batch."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.tanh_backward.default:
            out = out + 5 * out.mean(0)
        return out


def _loss_leaving_a_mode(o: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy that enters a dispatch mode and does not leave it: the engine's backward
    would run under it."""
    out = ce(o, y)
    if _SW["on"] and _real(o):
        while _LEAKED:  # (one at a time)
            _LEAKED.pop().__exit__(None, None, None)
        mode = _MixBackward()
        mode.__enter__()
        _LEAKED.append(mode)
    return out


def third_review_cleanup() -> None:
    """Leave the contexts an attack entered and did not leave; the switch off."""
    _SW["on"] = False
    _LAST.clear()
    while _LEAKED:
        _LEAKED.pop().__exit__(None, None, None)


def _conv_data():
    x, y = data()
    return x.unsqueeze(1), y


def _subclass_data():
    x, y = data()
    return x.as_subclass(_MixingInput), y


def _leaked(cm_factory):
    """A context entered before the step and left after it (e.g. entered by the model's
    constructor and never left)."""
    return cm_factory


_UNPACK = lambda t: t + 5 * t.mean(0) if t.ndim == 2 and t.shape[1] == 6 else t  # noqa: E731

from dpclip.engine.known_losses import cross_entropy_per_example as _cpe  # noqa: E402

#: name -> (model builder, data, loss, context around the step)
THIRD = {
    "softmax-dim-lying-int": (_softmax_lying_dim, data, _cpe, None),
    "batchnorm-training-lying-bool": (_batchnorm_lying_training, data, _cpe, None),
    "parameter-subclass-torch_function": (_parameter_subclass, data, _cpe, None),
    "hook-table-dict-subclass": (_hidden_hook_table, data, _cpe, None),
    "forward-hook-table-hides-values": (_forward_hook_hidden_from_values, data, ce, None),
    "instance-_conv_forward-known-chain": (lambda: _conv_mlp(False), _conv_data, _cpe, None),
    "instance-_conv_forward-cached-chain": (lambda: _conv_mlp(True), _conv_data, ce, None),
    "instance-_compiled_call_impl-known-chain": (_compiled_call_impl, data, _cpe, None),
    "cached-chain-hook-on-parameter-free-module": (_hook_on_parameter_free_module, data, ce,
                                                   None),
    "cached-chain-class-claiming-torch-module": (
        lambda: nn.Sequential(nn.Linear(5, 6), _TorchLooking(), nn.Linear(6, 3)), data, ce, None),
    "input-tensor-subclass-known-chain": (_mlp, _subclass_data, ce, None),
    "known-loss-lying-str-config": (_mlp, data, _lying_ce(), None),
    "torch-function-mode-around-step": (_mlp, data, _cpe, _CentreMode),
    "saved-tensor-hooks-around-step": (_mlp, data, _cpe,
                                       lambda: torch.autograd.graph.saved_tensors_hooks(
                                           lambda t: t, lambda t: _UNPACK(t) if _SW["on"] else t)),
    "instance-forward-on-ruled-layer": (_instance_forward_static, data, ce, None),
    "instance-forward-installed-for-the-call": (_InstallForward, data, ce, None),
    "class-swapped-for-the-call": (_SwapClass, data, ce, None),
    "subclass-__getattribute__-hands-another-forward": (_lookup_model, data, ce, None),
    "pre-hook-deletes-instance-forward": (_PreHookDeletesForward, data, ce, None),
    "kept-input-rewritten-version-reset": (_RewriteKeptInput, data, ce, None),
    "weight-rewritten-for-the-call-and-restored": (_RewriteWeightForTheCall, data, ce, None),
    "dispatch-mode-left-active-by-the-loss": (Net, data, _loss_leaving_a_mode, None),
    "per-layer-scale-operand-rewritten": (lambda: _RewritePerLayerArgument(True), data, ce, None),
    "per-layer-argument-rewritten": (lambda: _RewritePerLayerArgument(False), data, ce, None),
    # open until the fourth pass (test_hostile_review4.py)
    "autograd-saved-rewritten-version-reset": (_RewriteAutogradSaved, data, ce, None),
    "grad-hook-with-torch-function-off": (lambda: Net(_grad_hook_without_torch_function), data,
                                          ce, None),
    "per-layer-vmap-reads-global-batch": (_per_layer_global, data, ce, None),
}

#: still open: accepted by ghost and auto (strict xfail). The third review's three open holes
#: (a tensor autograd saved rewritten with its version counter reset, LOO 1.003 C; a gradient hook
#: registered with torch functions off, 2.07 C; the per-layer recomputation reading a global copy
#: of the real batch, 1.06 C) are refused since the fourth pass (tests/engine/test_hostile_review4.py)
_OPEN3: dict[str, str] = {}


def third_review_loo(engine, name: str) -> float | None:
    """LOO of attack ``name`` under ``engine`` after one honest call (switch off), or None when
    a step was refused."""
    return switched_loo(engine, *THIRD[name])


def switched_loo(engine, build, make_data, loss, ctx) -> float | None:
    """LOO of a switched attack (``_SW``) under ``engine`` after one honest call (switch off), or
    None when a step was refused; the caches of the proof cleared first, the attack's leftovers
    after (:func:`third_review_cleanup`)."""
    from dpclip.engine import batch_symbol

    batch_symbol._CACHE.clear()
    ghost_forward._CHAIN_LAYOUTS.clear()
    _SW["on"] = False
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = make_data()
    with ctx() if ctx is not None else contextlib.nullcontext():
        try:
            try:  # honest steps first, at every batch size the LOO meets (fills the caches)
                loo_distance(engine(), model, loss, x, y)
            except UnsupportedModelError:
                return None
            _SW["on"] = True
            return loo_distance(engine(), model, loss, x, y)
        except UnsupportedModelError:
            return None
        finally:
            third_review_cleanup()


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_OPEN3[n])) if n in _OPEN3 else n
    for n in THIRD])
def test_third_review_attack_never_exceeds_c(name, engine):
    """Refused, or LOO <= C."""
    got = third_review_loo(engine, name)
    assert got is None or got <= 1 + 1e-9, got


# ------------------------------------------------- third review: the refusals (docs/errors.md)


def test_error_95_code_replaced_on_a_ruled_layer_instance():
    """docs/errors.md entry 95: an instance forward installed for the call (and deleted by
    itself) on a ruled layer is refused at the call, under auto too (never a vmap fallback)."""
    for engine in (GhostEngine(), AutoEngine()):
        torch.manual_seed(0)
        model = _InstallForward().to(DT)
        x, y = data()
        with pytest.raises(UnsupportedModelError, match="runs code its class does not define "
                           r"\(its instance attribute 'forward'"):
            clipped_sum(engine, model, ce, x, y)


def test_error_96_user_code_around_the_step():
    """docs/errors.md entry 96: a torch function mode or saved-tensor hooks active when the
    step starts: every engine refuses (naming the context; vmap would run under the same user
    code, and so would every engine's own arithmetic); torch.device(...) is not user code and
    stays on ghost."""
    torch.manual_seed(0)
    model = _mlp().to(DT)
    x, y = data()
    for ctx, what in ((_CentreMode, "a torch function mode \\(_CentreMode\\) is active when "
                       "the step starts"),
                      (lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
                       "saved-tensor hooks .* are active when the step starts")):
        with ctx():
            for engine in (GhostEngine(), AutoEngine(), VmapEngine(), NaiveEngine()):
                with pytest.raises(UnsupportedModelError, match=what):
                    clipped_sum(engine, model, ce, x, y)
    with torch.device("cpu"):
        assert clipped_sum(GhostEngine(), model, ce, x, y)[1]["engine"] == "ghost"


def test_error_97_kept_input_rewritten_without_a_trace(monkeypatch):
    """docs/errors.md entry 97: a ruled layer's kept input rewritten after the layer used it,
    without a trace, is refused under ghost and auto (never a vmap fallback). Since the fourth
    pass the memory watch refuses it first (entry 101: the input is a tensor the call computed);
    with the watch emptied the engine's own check of what it kept still refuses it."""
    from dpclip.engine import proved_program
    from dpclip.engine.memory_watch import MemoryWatch

    class _Blind(MemoryWatch):
        def add(self, tensors):
            pass

    for blind in (False, True):
        if blind:
            monkeypatch.setattr(proved_program.ProgramMatch, "_watch", lambda self: _Blind())
        want = ("input of layer 'fc2' \\(Linear\\) was rewritten after the layer used it" if blind
                else "the memory of a tensor the call computed was written or replaced")
        for engine in (GhostEngine(), AutoEngine(compiled=False)):  # (the traced path)
            torch.manual_seed(0)
            model = _RewriteKeptInput().to(DT)
            x, y = data()
            clipped_sum(engine, model, ce, x, y)  # honest: the proof is cached
            _SW["on"] = True
            try:
                with pytest.raises(UnsupportedModelError, match=want):
                    clipped_sum(engine, model, ce, x, y)
            finally:
                _SW["on"] = False


def test_error_98_layer_state_written_for_the_call():
    """docs/errors.md entry 98: a ruled layer's weight written for its call without a trace and
    restored after it is refused under ghost and auto (never a vmap fallback)."""
    from dpclip.engine import batch_symbol

    for engine in (GhostEngine(), AutoEngine(compiled=False)):  # (the traced path)
        batch_symbol._CACHE.clear()
        torch.manual_seed(0)
        model = _RewriteWeightForTheCall().to(DT)
        x, y = data()
        clipped_sum(engine, model, ce, x, y)  # honest: the proof is cached
        _SW["on"] = True
        try:
            with pytest.raises(UnsupportedModelError, match="the memory of parameter "
                               "'fc1.weight' was written or replaced in the call"):
                clipped_sum(engine, model, ce, x, y)
        finally:
            _SW["on"] = False


def test_fingerprint_sees_any_change_and_only_a_change():
    """The kept-input fingerprint (dpclip.engine.saved_check): equal on an equal copy (any
    dtype), different after a row swap (same sum, same norms), a pair of sign flips (equal
    products of odd weights would cancel 64-bit words; 32-bit words do not), one ulp, a shape
    change."""
    from dpclip.engine.saved_check import fingerprint, unchanged

    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.complex64):
        t = (torch.randn(6, 7, 3, generator=g) * 3).to(dt)
        p = fingerprint(t)
        assert unchanged(t.clone(), p) and unchanged(t, p)
        swapped = t.clone()
        swapped[[0, 1]] = swapped[[1, 0]]
        assert not unchanged(swapped, p)
    t = torch.randn(8, 6, generator=g, dtype=DT)
    p = fingerprint(t)
    flipped = t.clone()
    flipped[0, 0], flipped[1, 1] = -flipped[0, 0], -flipped[1, 1]
    assert not unchanged(flipped, p)
    ulp = t.clone()
    ulp[3, 2] = torch.nextafter(ulp[3, 2], torch.tensor(10.0, dtype=DT))
    assert not unchanged(ulp, p)
    assert not unchanged(t.reshape(6, 8), p)


@pytest.mark.parametrize("memcmp", [True, False], ids=["cpu-bytes", "accelerator-sum"])
def test_batched_prints_agree_with_one_at_a_time(monkeypatch, memcmp):
    """``fingerprints`` / ``all_still`` (the contexts entered once, for the release checks over a
    model's parameters) give what ``fingerprint`` / ``still`` give tensor by tensor: the same
    kind, shape and dtype per print, every tensor still when unchanged (non-contiguous and empty
    ones included), and False as soon as ONE of them changed by one ulp, a write through .data
    with its version counter unchanged included; a length mismatch is an error."""
    from dpclip.engine import saved_check as sc

    if not memcmp:
        monkeypatch.setattr(sc, "_MEMCMP", None)
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(5, 4, generator=g), torch.randn(4, 6, generator=g, dtype=DT).t(),
          torch.zeros(0, 3), torch.randint(0, 9, (7,), generator=g),
          torch.randn(3, generator=g).to(torch.bfloat16)]
    prints = sc.fingerprints(ts)
    assert [p[1:] for p in prints] == [sc.fingerprint(t)[1:] for t in ts]
    assert sc.all_still(ts, prints)
    assert all(sc.all_true([sc.still(t, p)]) for t, p in zip(ts, prints))
    for i in (0, 1, 3, 4):
        changed = [t.clone() for t in ts]
        flat = changed[i].view(-1) if changed[i].is_contiguous() else changed[i]
        v = changed[i]._version
        if changed[i].is_floating_point():
            (flat if flat.ndim == 1 else flat[0]).data[0] = torch.nextafter(
                changed[i].reshape(-1)[0], torch.tensor(1e9, dtype=changed[i].dtype))
        else:
            flat.data[0] += 1
        assert changed[i]._version == v  # (a .data write: no version moved)
        assert not sc.all_still(changed, prints), i
        assert sc.all_still([t.clone() for t in ts], prints)
    with pytest.raises(ValueError, match="tensors against"):
        sc.all_still(ts[:2], prints)


def test_plain_models_keep_their_fast_paths():
    """The third review's checks refuse nothing an honest model does: a known chain with a known
    loss runs untraced, a cached chain reuses its layouts, torch's own configuration types pass
    (tuples, torch.Size, str padding)."""
    from dpclip.engine.plain_module import plain_instance

    for m in (nn.Conv1d(2, 3, 3, padding="same"), nn.Unflatten(1, torch.Size([2, 3])),
              nn.LayerNorm((4, 5)), nn.BatchNorm1d(4).eval(), nn.Dropout(0.1), nn.Softmax(-1)):
        assert plain_instance(m), m
    torch.manual_seed(0)
    model = _mlp().to(DT)
    x, y = data()
    chain = ghost_forward._plain_chain(model, {})
    assert chain is not None and ghost_forward._known_chain(chain)
    assert ghost_forward._chain_key(chain, x, {}) is not None
    _, info = clipped_sum(GhostEngine(), model, _cpe, x, y)
    assert info["engine"] == "ghost"


def test_a_print_taken_before_the_weight_pool_grew_still_matches(monkeypatch):
    """On an accelerator a print is a weighted sum of the words with weights from a pool grown on
    demand (dpclip.engine.saved_check); the pool was redrawn when it grew, so a print taken before
    a larger tensor was printed no longer matched its unchanged tensor: on CUDA a step whose
    Poisson batch was the largest so far refused "the input of layer 'conv1' was rewritten" (seen
    on an H200, `dpclip train` on Fashion-MNIST). Here the accelerator path on the CPU."""
    from dpclip.engine import saved_check as sc

    monkeypatch.setattr(sc, "_MEMCMP", None)
    monkeypatch.setattr(sc, "_POOLS", {})
    small = torch.randn(3, 5)
    printed = sc.fingerprint(small)
    assert printed[3] == "sum"
    sc.fingerprint(torch.randn(5000, 3000))  # both pools grow
    assert sc.unchanged(small, printed)
    small[1, 2] += 1
    assert not sc.unchanged(small, printed)


def test_ghost_on_the_accelerator_print_path_takes_a_larger_batch_after_a_smaller(monkeypatch):
    """The same through the ghost engine: a convolutional net whose second layer's input is larger
    than its first's (as the Papernot CNN's), a batch of 3 then a batch of 9, each equal to the
    float64 loop."""
    from dpclip.engine import saved_check as sc
    from dpclip.engine import ParamGroups
    from tests.engine.helpers import assert_equal_to_the_loop, ce, clip_weights

    monkeypatch.setattr(sc, "_MEMCMP", None)
    monkeypatch.setattr(sc, "_POOLS", {})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.Tanh(), nn.Conv2d(8, 2, 3), nn.Tanh(), nn.Flatten(),
                          nn.Linear(2 * 4 * 4, 3)).to(torch.float64)
    g = torch.Generator().manual_seed(0)
    for b in (3, 9):
        x = torch.randn(b, 1, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (b,), generator=g)
        res = GhostEngine().compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))
        assert_equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model))
