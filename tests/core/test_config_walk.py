"""The training configuration walk (issue 34): the clipping unit as its own argument in the API,
TrainConfig, the CLI and specs (the old spelling still read, with a deprecation note); TrainConfig
in privacy / optimisation / performance parts with a fingerprint that covers the first two by
construction; stored fingerprints kept."""

from __future__ import annotations

import dataclasses
import json
import tomllib

import pytest
import torch
from torch import nn

import dpclip
from dpclip.errors import DeprecatedSpellingWarning
from dpclip.harness.spec import parse_spec
from dpclip.training.config import (
    OptimisationConfig,
    PerformanceFlags,
    PrivacyConfig,
    TrainConfig,
)
from dpclip.training.units import UnitConfig
from tests.core._invariance_cases import (REFERENCE_PATH, fingerprint_run, same_run, state_hash,
                                         weights_probe)

BASE = dict(dataset="synthetic", model="mlp", noise_multiplier=1.0, strategy="fixed")


# ------------------------------------------------------------------ the unit, its own argument

def test_make_private_unit_argument_gives_the_pinned_ledger_and_weights():
    """``unit=`` gives exactly the run the old spelling gave (pinned on the old code)."""
    ref = json.loads(REFERENCE_PATH.read_text())
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x = torch.randn(200, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (200,), generator=g)
    model = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedSpellingWarning)  # the new spelling: no note
        dp = dpclip.make_private(model, opt, (x, y), batch_size=25, epochs=2, verbose=False,
                                 reproducible_noise=True, seed=5, strategy="vdv",
                                 noise_multiplier=0.4, sampling="fixed-size", accountant="rdp",
                                 unit="gbc", miniset_size=5)
    for _ in range(dp.epochs):
        for xb, yb in dp.loader:
            dp.step(xb, yb)
    assert dp.ledger.to_dict() == ref["api-gbc-vdv"]["ledger"]
    moved = same_run(ref["api-gbc-vdv"], {"ledger": ref["api-gbc-vdv"]["ledger"],
                                          "state_sha256": state_hash(model),
                                          "state_probe": weights_probe(model)})
    assert not moved, moved
    assert dp.unit == UnitConfig("gbc", 5)


def test_old_spelling_warns_naming_the_new_one_and_conflicts_are_refused():
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    kw = dict(noise_multiplier=1.0, steps=1, batch_size=16, verbose=False)
    with pytest.warns(DeprecatedSpellingWarning, match=r"unit='bc'"):
        dp = dpclip.make_private(nn.Linear(4, 2), None, (x, y), strategy_params={"unit": "bc"},
                                 **kw)
    assert dp.unit == UnitConfig("bc")
    with pytest.raises(ValueError, match=r"unit is given twice, 'gbc' .* and 'bc'"):
        dpclip.make_private(nn.Linear(4, 2), None, (x, y), unit="gbc", miniset_size=4,
                            strategy_params={"unit": "bc"}, **kw)
    with pytest.raises(ValueError, match="miniset_size= is part of the UnitConfig"):
        dpclip.make_private(nn.Linear(4, 2), None, (x, y), unit=UnitConfig("bc"),
                            miniset_size=4, **kw)
    with pytest.warns(DeprecatedSpellingWarning,
                      match=r"CLI --unit gbc; spec \[train\] unit = \"gbc\""):
        old = TrainConfig(**BASE, sampling="fixed-size", accountant="rdp",
                          strategy_params={"unit": "gbc", "miniset_size": "8", "clip_norm": 1})
    new = TrainConfig(**BASE, sampling="fixed-size", accountant="rdp", unit="gbc",
                      miniset_size=8, strategy_params={"clip_norm": 1})
    assert old == new and old.strategy_params == {"clip_norm": 1}
    assert old.unit_config == UnitConfig("gbc", 8)
    with pytest.raises(ValueError, match="unit is given twice"):
        TrainConfig(**BASE, unit="bc", strategy_params={"unit": "gbc"})
    with pytest.raises(ValueError, match=r"TrainConfig: unit='xc' is not a clipping unit"):
        TrainConfig(**BASE, unit="xc")
    with pytest.raises(ValueError, match=r"miniset_size \(--miniset-size\) must be an integer"):
        TrainConfig(**BASE, unit="gbc", miniset_size=2.5)


def test_cli_unit_flags_and_the_old_param(monkeypatch, capsys):
    from dpclip import cli

    seen = []
    monkeypatch.setattr(cli, "_resolve_train_config",
                        lambda c, *a: seen.append(c) or (_ for _ in ()).throw(SystemExit(0)))
    common = ["train", "--dataset", "synthetic", "--model", "bn-lenet5", "--noise-multiplier",
              "1", "--epochs", "1", "--sampling", "fixed-size", "--accountant", "rdp",
              "--no-progress"]
    with pytest.raises(SystemExit):
        cli.main(common + ["--unit", "gbc", "--miniset-size", "4", "--bn-stats", "public",
                           "--public-fraction", "0.2"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(common + ["--param", "unit=gbc", "--param", "miniset_size=4", "--param",
                           "bn_stats=public", "--param", "public_fraction=0.2"])
    err = capsys.readouterr().err  # the CLI says the deprecation as one of its warnings
    assert "dpclip train: warning: TrainConfig: the clipping unit setting unit='gbc' inside " \
        "the strategy's parameters is deprecated; give it as its own argument: unit='gbc' " \
        "(CLI --unit gbc; spec [train] unit = \"gbc\")" in err
    assert seen[0] == seen[1]
    assert seen[0].unit_config == UnitConfig("gbc", 4, "public", 0.2)
    assert seen[0].fingerprint() == seen[1].fingerprint()


def test_spec_reads_train_unit_and_the_old_params_unit_alike():
    raw = tomllib.loads("""
name = "units"
[train]
dataset = "synthetic"
model = "bn-lenet5"
sampling = "fixed-size"
accountant = "rdp"
unit = "bc"
[grid]
noise_multipliers = [1.0]
[[strategies]]
name = "fixed"
params = { clip_norm = 0.5 }
""")
    new = parse_spec(raw).runs()[0].config
    raw["train"].pop("unit")
    raw["strategies"][0]["params"]["unit"] = "bc"
    with pytest.warns(DeprecatedSpellingWarning, match="spec \\[train\\] unit"):
        old = parse_spec(raw).runs()[0].config
    assert new == old and new.unit == "bc" and new.strategy_params == {"clip_norm": 0.5}
    assert new.fingerprint() == old.fingerprint()


# ----------------------------------------------------------- parts and fingerprint by construction

def test_every_field_belongs_to_exactly_one_part():
    parts = [{f.name for f in dataclasses.fields(c)}
             for c in (PrivacyConfig, OptimisationConfig, PerformanceFlags)]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    assert set().union(*parts) == {f.name for f in dataclasses.fields(TrainConfig)}
    c = TrainConfig(**BASE, unit="bc", engine="vmap", lr=0.3)
    assert c.privacy.unit == "bc" and c.optimisation.lr == 0.3 and c.performance.engine == "vmap"
    # the parts carry the same defaults as the flat front
    for cls in (PrivacyConfig, OptimisationConfig, PerformanceFlags):
        for f in dataclasses.fields(cls):
            assert getattr(cls(), f.name) == getattr(TrainConfig(**BASE), f.name) or \
                f.name in BASE, f.name


#: a changed value for every field (valid with BASE and the field's DEPENDS)
CHANGED = dict(
    dataset="breast-cancer", dataset_options={"n_train": 100}, strategy="auto-s",
    strategy_params={"clip_norm": 0.5}, unit="bc", miniset_size=8, public_fraction=0.2,
    epsilon=3.0, noise_multiplier=1.5, delta=1e-6, epochs=2, batch_size=64,
    sampling="fixed-size", accountant="rdp", reproducible_noise=True, model="logreg",
    model_options={"hidden": 8}, lr=0.5, lr_schedule="cosine", lr_gamma=0.1,
    lr_step_epochs=2, lr_min=0.01, lr_warmup_epochs=0.5, augment="flip",
    augment_multiplicity=2, averaging="ema:0.9", optimizer="adam", momentum=0.5,
    weight_decay=0.01, seed=7, bn_stats="batch", diagnostics="test",
    engine="vmap", max_physical_batch=32, eval_batch_size=64, data_dir="/elsewhere",
    device="cpu", eval_every=0)
#: the other fields a changed field needs (set in both configs compared)
DEPENDS = {
    "miniset_size": dict(unit="gbc", miniset_size=4, sampling="fixed-size", accountant="rdp"),
    "lr_gamma": dict(lr_schedule="step", lr_gamma=0.5, lr_step_epochs=1),
    "lr_step_epochs": dict(lr_schedule="step", lr_gamma=0.5, lr_step_epochs=1),
    "lr_min": dict(lr_schedule="cosine"),
    "augment_multiplicity": dict(augment="flip"),
}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(TrainConfig)])
def test_performance_flags_keep_the_fingerprint_other_fields_change_it(name):
    before = TrainConfig(**{**BASE, **DEPENDS.get(name, {})})
    after = dataclasses.replace(before, **{name: CHANGED[name]})
    assert getattr(after, name) != getattr(before, name)
    performance = name in {f.name for f in dataclasses.fields(PerformanceFlags)}
    assert (after.fingerprint() == before.fingerprint()) == performance


def test_stored_fingerprints_are_kept():
    """Computed with the code before the refactoring (b8f43ed), the unit inside
    strategy_params: the runs in stores and checkpoints keep their identity."""
    old = {
        "default": ({}, "4092eb1b91a298c0"),
        "bc": ({"unit": "bc", "strategy_params": {"clip_norm": 0.5}}, "c38ada5fc53b4392"),
        "gbc": ({"unit": "gbc", "miniset_size": 8, "sampling": "fixed-size",
                 "accountant": "rdp"}, "cf6f146925032f9e"),
        "bn-public": ({"unit": "bc", "bn_stats": "public", "public_fraction": 0.2},
                      "02c009382db20428"),
        "alc": ({"strategy": "alc", "public_fraction": 0.25}, "ffe5f1e793c3dbb5"),
        "seeded": ({"reproducible_noise": True, "seed": 4, "lr": 0.3, "epochs": 3},
                   "790fac6c752fac88"),
    }
    for name, (kw, fp) in old.items():
        assert TrainConfig(**{**BASE, **kw}).fingerprint() == fp, name


def test_refactor_invariance_runs_use_the_new_spelling_too():
    """The pinned TrainConfig runs give the same ledger and weights with ``unit=``."""
    ref = json.loads(REFERENCE_PATH.read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the references were computed (reduction order)
    try:
        got = fingerprint_run("gbc-fixed-size", new_spelling=True)
    finally:
        torch.set_num_threads(threads)
    moved = same_run(ref["gbc-fixed-size"], got)
    assert not moved, moved


def test_config_dicts_round_trip_and_refuse_unknown_keys_by_name():
    """``DictFields`` (TrainConfig, GreedyConfig): ``from_dict(to_dict())`` is the identity; a key
    that is not a field is refused naming it, the class and the valid fields."""
    import pytest

    from dpclip.search import GreedyConfig
    from dpclip.training.config import TrainConfig

    for cfg in (TrainConfig(dataset="digits", model="logreg", noise_multiplier=1.0),
                GreedyConfig(dataset="digits", model="logreg", noise_multiplier=1.0,
                             batch_size=256, lr=0.5, epochs=2)):
        cls = type(cfg)
        assert cls.from_dict(cfg.to_dict()) == cfg
        with pytest.raises(ValueError, match=rf"{cls.__name__}: unknown field\(s\) \['lr_rate'\]; "
                                             r"valid: \[.*'lr'"):
            cls.from_dict({**cfg.to_dict(), "lr_rate": 0.1})
