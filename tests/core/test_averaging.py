"""Weight averaging (dpclip.training.averaging): EMA and Polyak against a float64 hand-written oracle,
post-processing only (the ledger and the trained iterates are unchanged), in the fingerprint, in
the checkpoint (resume identical), evaluated on the averaged weights."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from torch import nn

from dpclip.training.averaging import Averaging, WeightAverager, parse_averaging
from dpclip.data import load_dataset
from dpclip.training.private import make_private
from dpclip.training.trainer import TrainConfig, evaluate, train


@pytest.mark.parametrize("text,want", [
    ("none", None), ("", None), (None, None),
    ("ema:0.999", Averaging("ema", 0.999, 0)),
    (" EMA:0.9:25 ", Averaging("ema", 0.9, 25)),
    ("polyak:1000", Averaging("polyak", None, 1000)),
    ("polyak:0", Averaging("polyak", None, 0)),
])
def test_parse_and_canonical_text(text, want):
    got = parse_averaging(text)
    assert got == want
    if got is not None:
        assert parse_averaging(got.spec) == got


@pytest.mark.parametrize("text,match", [
    ("ema", "cannot parse 'ema'"),
    ("ema:1.0", r"the EMA decay must be in \(0, 1\)"),
    ("ema:0", r"the EMA decay must be in \(0, 1\)"),
    ("ema:nan", r"the EMA decay must be in \(0, 1\)"),
    ("ema:abc", "cannot parse"),
    ("ema:0.9:-3", "the start step must be an integer >= 0"),
    ("polyak", "cannot parse 'polyak'"),
    ("polyak:1.5", "the start step must be an integer >= 0"),
    ("swa:10", "cannot parse 'swa:10'"),
])
def test_bad_averaging_names_the_argument_and_the_grammar(text, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_averaging(text, "--averaging")
    assert str(info.value).startswith("--averaging")


def _data(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, dtype=torch.float64, generator=g), torch.randint(0, 3, (n,),
                                                                              generator=g)


def _model():
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    m.register_buffer("counter", torch.zeros(2, dtype=torch.float64))  # a public buffer
    return m


def _dp(averaging, steps=9, **kw):
    x, y = _data()
    m = _model()
    opts = dict(strategy="fixed", strategy_params={"clip_norm": 0.5}, noise_multiplier=1.0,
                steps=steps, batch_size=8.0, delta=1e-5, reproducible_noise=True, seed=3,
                verbose=False, averaging=averaging)
    opts.update(kw)
    return make_private(m, torch.optim.SGD(m.parameters(), lr=0.3), (x, y), **opts), m


def _oracle(iterates, kind, decay, start):
    """a_n from the parameters theta_0 .. theta_N (float64, one loop, the module's formula)."""
    a = {k: v.clone() for k, v in iterates[0].items()}
    for n in range(1, len(iterates)):
        th = iterates[n]
        if n <= start:
            a = {k: v.clone() for k, v in th.items()}
            continue
        t = n - start - 1
        w = 1.0 / (t + 1) if kind == "polyak" else 1.0 - min(decay, (1.0 + t) / (10.0 + t))
        a = {k: (1 - w) * a[k] + w * th[k] for k in a}
    return a


@pytest.mark.parametrize("spec,kind,decay,start", [
    ("ema:0.95", "ema", 0.95, 0), ("ema:0.5:3", "ema", 0.5, 3),
    ("polyak:0", "polyak", None, 0), ("polyak:4", "polyak", None, 4)])
def test_average_equals_the_float64_oracle(spec, kind, decay, start):
    dp, m = _dp(spec)
    iterates = [{n: p.detach().clone() for n, p in m.named_parameters()}]
    while not dp.exhausted:
        dp.step(*dp.sample())
        iterates.append({n: p.detach().clone() for n, p in m.named_parameters()})
    want = _oracle(iterates, kind, decay, start)
    avg = dp.averaged_model()
    for n, p in avg.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-12, atol=1e-14)
    # the EMA warm-up: with decay 0.95 the first averaged step weighs theta_1 by 0.9
    if spec == "ema:0.95":
        first = _oracle(iterates[:2], kind, decay, start)
        ref = {k: 0.1 * iterates[0][k] + 0.9 * iterates[1][k] for k in first}
        for k in ref:
            torch.testing.assert_close(first[k], ref[k])


def test_post_processing_only_the_ledger_and_iterates_do_not_change():
    plain, m_plain = _dp(None)
    avg, m_avg = _dp("ema:0.9")
    while not plain.exhausted:
        plain.step(*plain.sample())
        avg.step(*avg.sample())
    assert avg.ledger == plain.ledger
    assert avg.epsilon() == plain.epsilon()
    for (n, a), (_, b) in zip(m_plain.state_dict().items(), m_avg.state_dict().items()):
        assert torch.equal(a, b), n  # the trained (last) iterate is untouched
    assert any(not torch.equal(p, q) for p, q in zip(avg.averaged_model().parameters(),
                                                      m_avg.parameters()))
    assert avg.describe()["averaging"] == "ema:0.9" and plain.describe()["averaging"] == "none"


def test_swap_in_context_restores_the_iterate_and_buffers_are_not_averaged():
    dp, m = _dp("polyak:0", steps=4)
    while not dp.exhausted:
        dp.step(*dp.sample())
    m.counter.fill_(7.0)  # a buffer changed after training: the averaged model uses it as it is
    last = {n: p.detach().clone() for n, p in m.named_parameters()}
    with dp.averaged_weights() as model:
        assert model is m
        for n, p in m.named_parameters():
            assert torch.equal(p, dp.averager.average[n])
    for n, p in m.named_parameters():
        assert torch.equal(p, last[n])
    with pytest.raises(RuntimeError, match="boom"):  # restored on an exception too
        with dp.averaged_weights():
            raise RuntimeError("boom")
    for n, p in m.named_parameters():
        assert torch.equal(p, last[n])
    assert torch.equal(dp.averaged_model().counter, torch.full((2,), 7.0, dtype=torch.float64))


def test_own_loop_must_fold_each_step_in():
    dp, m = _dp("ema:0.9", steps=3)
    xb, yb = dp.sample()
    dp.backward(xb, yb)
    dp.optimizer.step()
    xb, yb = dp.sample()
    with pytest.raises(ValueError, match=r"call dp.update_average\(\) after each "
                                         r"optimizer.step\(\)"):
        dp.backward(xb, yb)
    dp.update_average()
    dp.backward(xb, yb)  # the same batch: a refused backward leaves it unreleased (loop rules)
    off, _ = _dp(None)
    with pytest.raises(ValueError, match="averaged_model: averaging is off"):
        off.averaged_model()
    with pytest.raises(ValueError, match="update_average: averaging is off"):
        off.update_average()


def test_resume_is_identical_and_mismatched_averaging_is_refused():
    full, m_full = _dp("ema:0.8:2")
    while not full.exhausted:
        full.step(*full.sample())
    part, _ = _dp("ema:0.8:2")
    for _ in range(4):
        part.step(*part.sample())
    state = part.state_dict()
    resumed, _ = _dp("ema:0.8:2")
    resumed.load_state_dict(state)
    while not resumed.exhausted:
        resumed.step(*resumed.sample())
    assert resumed.ledger == full.ledger
    for (n, a), (_, b) in zip(full.averaged_model().state_dict().items(),
                              resumed.averaged_model().state_dict().items()):
        assert torch.equal(a, b), n
    other, _ = _dp("polyak:0")
    with pytest.raises(ValueError, match="the checkpoint averaged with 'ema:0.8:2'"):
        other.load_state_dict(state)
    plain, _ = _dp(None)
    with pytest.raises(ValueError, match="checkpoint was written with averaging 'ema:0.8:2'"):
        plain.load_state_dict(state)
    with pytest.raises(ValueError, match="checkpoint was written without weight averaging"):
        _dp("ema:0.8:2")[0].load_state_dict(plain.state_dict())


def test_averager_alone_keeps_float64_and_refuses_a_changed_model():
    m = nn.Linear(3, 2)
    avg = WeightAverager(m, Averaging("polyak", None, 0))
    assert all(a.dtype == torch.float64 for a in avg.average.values())
    m.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="trainable parameters changed"):
        avg.update()


# ----------------------------------------------------------------------------------- trainer
BASE = dict(dataset="synthetic", model="mlp", strategy="fixed", strategy_params={"clip_norm": 1.0},
            delta=1e-5, epochs=2, batch_size=32, lr=0.5, optimizer="momentum", seed=0,
            noise_multiplier=0.8, dataset_options={"image_shape": [1, 6, 6], "n_train": 256})


def test_trainconfig_fingerprint_covers_averaging_and_keeps_old_fingerprints():
    a = TrainConfig(**BASE)
    assert a.averaging == "none" and a.augment_multiplicity == 1
    d = a.to_dict()
    d["max_physical_batch"] = 256  # (the default of older configs: hashed at it)
    for k in ("augment", "augment_multiplicity", "averaging", "data_dir", "device", "eval_every",
              "lr_schedule", "lr_gamma", "lr_step_epochs", "lr_min", "lr_warmup_epochs",
              "unit", "miniset_size", "bn_stats", "public_fraction"):  # unit fields: at default
        d.pop(k)
    assert a.fingerprint() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()
                                             ).hexdigest()[:16]
    b = TrainConfig(**BASE, averaging=" EMA:0.999 ")
    assert b.averaging == "ema:0.999"
    assert b.fingerprint() != a.fingerprint()
    assert TrainConfig(**BASE, averaging="ema:0.99").fingerprint() != b.fingerprint()
    with pytest.raises(ValueError, match=r"TrainConfig: averaging \(--averaging\): cannot parse "
                                         r"'swa'"):
        TrainConfig(**BASE, averaging="swa")
    with pytest.raises(ValueError, match=r"averaging \(--averaging\) must be a string"):
        TrainConfig(**BASE, averaging=0.99)


def test_train_evaluates_and_returns_the_averaged_weights_and_resumes_identically(tmp_path):
    cfg = TrainConfig(**BASE, averaging="ema:0.9", reproducible_noise=True)
    full = train(cfg, progress=False)
    assert full.summary["averaging"] == "ema:0.9"
    bundle = load_dataset("synthetic", None, seed=0, **BASE["dataset_options"])
    ev = evaluate(full.model, bundle.test.inputs, bundle.test.targets, 2048)
    assert ev["accuracy"] == full.history[-1]["test_accuracy"]
    plain = train(TrainConfig(**BASE, reproducible_noise=True), progress=False)
    assert plain.ledger == full.ledger  # post-processing: the same events
    assert any(not torch.equal(a, b) for a, b in zip(plain.model.state_dict().values(),
                                                     full.model.state_dict().values()))
    train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=5)
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ck["private"]["averaging"]["spec"] == "ema:0.9"
    resumed = train(cfg, checkpoint_dir=tmp_path, progress=False)
    assert resumed.ledger == full.ledger
    assert resumed.history == [dict(r, wall_seconds=resumed.history[i]["wall_seconds"],
                                    ms_per_step=resumed.history[i].get("ms_per_step"))
                               if "ms_per_step" in r else dict(
                                   r, wall_seconds=resumed.history[i]["wall_seconds"])
                               for i, r in enumerate(full.history)]
    for (n, a), (_, b) in zip(full.model.state_dict().items(),
                              resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
