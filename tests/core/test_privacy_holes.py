"""Regression tests for the privacy holes of issue 15 closed in the trainer, sampler and step:
secret randomness (item 1), exact Poisson inclusion (8), private buffers (7), the data in the
checkpoint fingerprint (9), the engine that ran (11) and diagnostics off private data (12)."""

import json
import shutil
import tomllib
from importlib import resources

import numpy as np
import pytest
import torch
from torch import nn

from dpclip.clipping import StepContext, make_strategy
from dpclip.data import load_dataset
from dpclip.engine import ParamGroups, UnsupportedModelError, get_engine
from dpclip.randomness import PrivateRandomness, secure_generator, seeded_generator
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import PrivateBufferError, dp_step
from dpclip.training.trainer import TrainConfig, cross_entropy_per_example, train

BASE = dict(dataset="synthetic", model="mlp", strategy="fixed",
            strategy_params={"clip_norm": 1.0}, delta=1e-5, epochs=1, batch_size=64, lr=0.5,
            optimizer="momentum", seed=0, noise_multiplier=1.0)


def _weights(res) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in res.model.parameters()])


# ------------------------------------------------------------------ item 1: secret randomness


def test_same_seed_gives_different_noise_by_default():
    """Before: noise and sampling were seeded with 2 seed + 1/2, so the published seed replayed them."""
    a = train(TrainConfig(**BASE), progress=False)
    b = train(TrainConfig(**BASE), progress=False)
    assert a.summary["seed"] == b.summary["seed"] == 0
    assert not torch.equal(_weights(a), _weights(b))
    assert a.summary["randomness"] == "secure" and a.summary["private_against_seed"] is True
    assert "randomness_warning" not in a.summary


def test_the_published_seed_does_not_replay_a_secure_run():
    """The attack of the issue: rerun with the generators derived from the published seed."""
    secure = train(TrainConfig(**BASE), progress=False)
    replay = train(TrainConfig(**BASE, reproducible_noise=True), progress=False)
    assert not torch.equal(_weights(secure), _weights(replay))


def test_reproducible_noise_replays_and_is_labelled_not_private():
    a = train(TrainConfig(**BASE, reproducible_noise=True), progress=False)
    b = train(TrainConfig(**BASE, reproducible_noise=True), progress=False)
    assert torch.equal(_weights(a), _weights(b))
    s = a.summary
    assert s["randomness"] == "reproducible" and s["private_against_seed"] is False
    assert "NOT private" in s["randomness_warning"]


def test_seed_still_fixes_the_public_choices():
    """--seed keeps its meaning for model initialisation: same initial model, different noise."""
    cfg = dict(BASE, lr=1e-12)  # the weights barely move: they are the initial ones
    a = train(TrainConfig(**cfg), progress=False)
    b = train(TrainConfig(**cfg), progress=False)
    assert torch.allclose(_weights(a), _weights(b), atol=1e-6)


def test_secure_generator_state_is_full_entropy_not_a_32_bit_seed():
    # torch's manual_seed keeps 32 bits: seeds s and s + 2**32 give the same stream
    g1, g2 = seeded_generator(5), seeded_generator(5 + 2**32)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))
    # a secure generator's Mersenne Twister words do not follow the seeding recurrence
    g = secure_generator()
    raw = g.get_state().numpy().tobytes()
    from dpclip.randomness import _mt_state_offset

    words = np.frombuffer(raw, dtype=np.uint64, count=624, offset=_mt_state_offset())
    w0 = int(words[0])
    assert int(words[1]) != (1812433253 * (w0 ^ (w0 >> 30)) + 1) & 0xFFFFFFFF
    assert len(set(int(w) for w in words)) > 600 and int(words.max()) < 2**32
    a, b = secure_generator(), secure_generator()
    assert not torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


def test_randomness_state_roundtrips_and_repr_shows_no_state():
    r = PrivateRandomness.secure()
    st = r.state_dict()
    x = torch.randn(5, generator=r.noise)
    r2 = PrivateRandomness.secure()
    r2.load_state_dict(st)
    assert torch.equal(torch.randn(5, generator=r2.noise), x)
    assert repr(r) == "PrivateRandomness(mode='secure')"
    with pytest.raises(ValueError, match="mode"):
        PrivateRandomness.reproducible(0).load_state_dict(st)


def test_secure_resume_continues_the_stored_stream(tmp_path):
    """The private checkpoint keeps the generator state: two resumes of one checkpoint agree."""
    cfg = TrainConfig(**dict(BASE, epochs=2))
    part = train(cfg, checkpoint_dir=tmp_path / "a", progress=False, stop_after_steps=5)
    assert part.summary.get("interrupted")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    ra = train(cfg, checkpoint_dir=tmp_path / "a", progress=False)
    rb = train(cfg, checkpoint_dir=tmp_path / "b", progress=False)
    assert torch.equal(_weights(ra), _weights(rb))
    assert ra.ledger == rb.ledger
    # the state lives in the checkpoint only, never in the summary
    text = json.dumps(ra.summary, default=str)
    assert "sampling_state" not in text and "'noise'" not in text
    ck = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    assert ck["private"]["randomness"]["mode"] == "secure"
    assert "sample_gen" not in ck and "noise_gen" not in ck


def test_cli_reproducible_noise_warns(tmp_path, capsys):
    from dpclip.cli import main

    args = ["train", "--dataset", "synthetic", "--model", "mlp", "--noise-multiplier", "1",
            "--delta", "1e-5", "--epochs", "1", "--batch-size", "64", "--lr", "0.5",
            "--db", str(tmp_path / "r.db"), "--no-progress", "--json"]
    assert main(args + ["--reproducible-noise"]) == 0
    out, err = capsys.readouterr()
    row = json.loads(out.strip().splitlines()[-1])
    assert row["randomness"] == "reproducible" and "NOT private" in err
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["randomness"] == "secure"
    assert "NOT private" not in err


def test_reports_label_seeded_runs():
    from dpclip.harness.evidence import markdown_table

    row = dict(dataset="d", model="m", strategy="fixed", params={}, epsilon=1.0, delta=1e-5,
               seed=0, epochs=1, test_accuracy=0.5)
    md = markdown_table([row], "t")  # a row without the field predates secure randomness
    assert "| seeded |" in md and "NOT private against anyone who knows the seed" in md
    md = markdown_table([dict(row, randomness="secure")], "t")
    assert "| secure |" in md and "NOT private" not in md


# --------------------------------------------------------- item 8: exact Poisson inclusion


def test_poisson_inclusion_probability_never_exceeds_q():
    for n, b in [(60000, 256.0), (455, 64.0), (10**7, 0.3), (3, 1.0)]:
        s = PoissonSampler(n, b)
        p = s.inclusion_probability
        assert p <= s.sample_rate and s.sample_rate - p < 2.0**-52
    # the membership rule: a uniform integer in [0, 2**53) below floor(q 2**53)
    s = PoissonSampler(1000, 100.0)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    idx = s.sample(g1)
    u = torch.randint(0, 2**53, (1000,), generator=g2, dtype=torch.int64)
    assert torch.equal(idx, (u < s.inclusion_threshold).nonzero(as_tuple=True)[0])


def test_poisson_tiny_rate_is_not_rounded_up_to_the_float32_grid():
    """float32 uniforms lie on a 2**-24 grid: u < q for q < 2**-24 still fires when u == 0,
    i.e. with probability 2**-24, far above q. With 53-bit integers a rate of 1e-12 over 2e6
    examples x 8 draws includes nobody (expected 1.6e-5 examples)."""
    s = PoissonSampler(2_000_000, 2e-6)
    g = torch.Generator().manual_seed(0)
    assert sum(int(s.sample(g).numel()) for _ in range(8)) == 0


# ------------------------------------------------------------------- item 7: private buffers


def _in_model(affine: bool) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2, affine=affine,
                                                                track_running_stats=True),
                         nn.Flatten(), nn.Linear(2 * 6 * 6, 3))


def _step(model, engine: str, unit=None):
    strat = make_strategy("fixed", {"clip_norm": 1.0})
    ctx = StepContext(step=0, epoch=0, steps_per_epoch=1, total_steps=1,
                      expected_batch_size=8.0, base_noise_multiplier=1.0)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    return dp_step(model, x, y, loss_fn=cross_entropy_per_example, strategy=strat,
                   state=strat.init_state(), engine=get_engine(engine),
                   groups=ParamGroups.flat(model), sampler=PoissonSampler(100, 8.0),
                   base_noise_multiplier=1.0, ctx=ctx, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("engine", ["ghost", "auto", "vmap", "naive"])
def test_instancenorm_running_stats_are_refused_and_restored(engine):
    """Before: ghost/auto ran and the running statistics absorbed the private batch. Now every
    engine refuses (the buffer guard, the ghost separability check, or vmap's own error) and the
    buffers are as before the step."""
    torch.manual_seed(0)
    model = _in_model(affine=False)
    before = {k: v.clone() for k, v in model.named_buffers()}
    with pytest.raises((PrivateBufferError, UnsupportedModelError, RuntimeError)) as info:
        _step(model, engine)
    if engine == "naive":
        assert isinstance(info.value, PrivateBufferError)
        assert "track_running_stats=False" in str(info.value)
    for k, v in model.named_buffers():
        assert torch.equal(v, before[k]), k


def test_the_buffer_guard_restores_whatever_the_engine_did():
    """The guard itself, on an engine that runs the forward as a plain batch (naive oracle)."""
    from dpclip.training.step import private_buffer_guard

    model = _in_model(affine=True)
    before = {k: v.clone() for k, v in model.named_buffers()}
    with pytest.raises(PrivateBufferError, match="1.running_mean"):
        with private_buffer_guard(model):
            model(torch.randn(4, 1, 8, 8))
    for k, v in model.named_buffers():
        assert torch.equal(v, before[k]), k


def test_a_buffer_replaced_during_the_step_is_refused_and_put_back():
    class Cache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.register_buffer("last", torch.zeros(4))

        def forward(self, x):
            self.last = x.detach().mean(0)  # a new tensor holding private statistics
            return self.lin(x)

    model = Cache()
    orig = model.last
    strat = make_strategy("fixed", {"clip_norm": 1.0})
    ctx = StepContext(step=0, epoch=0, steps_per_epoch=1, total_steps=1,
                      expected_batch_size=8.0, base_noise_multiplier=1.0)
    # (refused by the chunk's isolation, dpclip.engine.isolation, inside the state guard)
    with pytest.raises((PrivateBufferError, UnsupportedModelError), match="buffer 'last'|'last'"):
        dp_step(model, torch.randn(8, 4), torch.randint(0, 3, (8,)),
                loss_fn=cross_entropy_per_example, strategy=strat, state=strat.init_state(),
                engine=get_engine("naive"), groups=ParamGroups.flat(model),
                sampler=PoissonSampler(100, 8.0), base_noise_multiplier=1.0, ctx=ctx,
                generator=torch.Generator().manual_seed(0))
    assert model.last is orig and torch.equal(orig, torch.zeros(4))


def test_models_without_buffer_updates_are_unaffected():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2), nn.Flatten(),
                          nn.Linear(2 * 6 * 6, 3))
    out = _step(model, "auto")
    assert out.engine_info["requested"] == "auto"


# --------------------------------------------------- item 9: data in the checkpoint fingerprint


def test_resume_on_different_data_is_refused(tmp_path):
    cfg = TrainConfig(**dict(BASE, epochs=2))
    train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=3)
    other = load_dataset("synthetic", None, seed=1)  # same name and shapes, other records
    with pytest.raises(ValueError, match="different data"):
        train(cfg, data=other, checkpoint_dir=tmp_path, progress=False)
    same = load_dataset("synthetic", None, seed=0)
    res = train(cfg, data=same, checkpoint_dir=tmp_path, progress=False)
    assert res.summary["steps"] == res.summary["planned_steps"]


def test_a_changed_config_on_resume_names_the_fields(tmp_path):
    cfg = TrainConfig(**dict(BASE, epochs=2))
    train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=2)
    with pytest.raises(ValueError, match=r"lr: 0\.5 -> 0\.1"):
        train(TrainConfig(**dict(BASE, epochs=2, lr=0.1)), checkpoint_dir=tmp_path,
              progress=False)


# ------------------------------------------------------------- item 11: the engine that ran


def test_summary_records_the_engine_that_ran():
    auto = train(TrainConfig(**dict(BASE, engine="auto")), progress=False).summary
    assert auto["engine_requested"] == "auto" and auto["engine"] == "ghost"
    ada = train(TrainConfig(**dict(BASE, engine="auto", strategy="adaclip",
                                   strategy_params={"initial_clip_norm": 1.0})),
                progress=False).summary
    assert ada["engine"] == "vmap" and ada["engine_requested"] == "auto"
    assert ada["engine_fallback"] and "P-GRAD" in ada["engine_fallback"][0]
    plain = train(TrainConfig(**dict(BASE, engine="vmap")), progress=False).summary
    assert plain["engine"] == "vmap" and plain["engine_fallback"] is None
    assert TrainConfig(**BASE).engine == "auto"  # the default (issue 17)


# ------------------------------------------------------ item 12: diagnostics off private data


def test_quick_demo_computes_no_diagnostics_on_private_data():
    raw = tomllib.loads(resources.files("dpclip.harness").joinpath("presets/quick.toml")
                        .read_text())
    assert raw["train"].get("diagnostics", False) in (False, "off", "test")


def test_test_split_diagnostics_use_heldout_keys_only():
    res = train(TrainConfig(**dict(BASE, diagnostics="test")), progress=False)
    row = res.history[-1]
    assert any(k.startswith("heldout/norm_q") for k in row)
    assert not any(k.startswith("nonprivate/") for k in row)
    assert res.summary["diagnostics"] == "test split"
    with pytest.raises(ValueError, match="diagnostics"):
        TrainConfig(**dict(BASE, diagnostics="yes"))


def test_published_fallback_reasons_do_not_reveal_batch_sizes():
    """The ghost engine's fallback reason quotes tensor shapes, whose first dimension is the
    realised Poisson batch size; the public record keeps the words only (one reason, not one per
    batch size), and batches of fewer than 2 examples (trivially separable) are not counted."""
    import re

    from dpclip import make_private

    class Centred(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x - x.mean(0, keepdim=True))  # mixes the examples of the batch

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 4, generator=g), torch.randint(0, 3, (200,), generator=g)
    dp = make_private(Centred(), None, (x, y), noise_multiplier=1.0, steps=12, batch_size=20,
                      delta=1e-5, engine="auto")
    sizes = set()
    for _ in range(12):
        xb, yb = dp.sample()
        sizes.add(int(xb.shape[0]))
        dp.backward(xb, yb)
    assert len(sizes) > 1
    info = dp.engine_info
    assert info["engine"] == "vmap" and len(info["fallback"]) == 1
    assert not re.search(r"\(\d", info["fallback"][0]), info["fallback"][0]
    assert not any(str(s) in re.findall(r"\d+", info["fallback"][0]) for s in sizes if s > 9)
