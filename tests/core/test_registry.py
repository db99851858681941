"""The one registry helper (``dpclip.registry``): names, did-you-mean, listing, and the one
string-to-type converter behind strategies, models, datasets, engines and the CLI."""

from __future__ import annotations

from typing import Any

import pytest

from dpclip.clipping import STRATEGIES, make_strategy
from dpclip.data import DATASETS
from dpclip.engine import ENGINES, get_engine
from dpclip.models import MODELS, build_model
from dpclip.registry import Registry, coerce


def test_every_name_table_is_one_registry_class() -> None:
    for reg, kind in ((STRATEGIES, "strategy"), (MODELS, "model"), (DATASETS, "dataset"),
                      (ENGINES, "engine")):
        assert isinstance(reg, Registry) and reg.kind == kind
    # the bound-based strategies and the Lipschitz models register from the room above
    assert STRATEGIES["lip-dp-sgd"].kind == "bound" and "lip-orth-cnn" in MODELS
    assert tuple(ENGINES) == ("vmap", "ghost", "auto", "compiled", "naive", "summed")  # one list


def test_register_twice_and_unknown_names_name_the_argument() -> None:
    reg: Registry[Any] = Registry("widget")
    reg.register(object(), "a-b")
    with pytest.raises(ValueError, match="widget 'a-b' is already registered"):
        reg.register(object(), "a-b")
    with pytest.raises(ValueError, match=r"^f: unknown widget 'a_b' \(did you mean 'a-b'\?\); "
                                         r"valid widgets: a-b$"):
        reg.lookup("a_b", "f: ")
    with pytest.raises(ValueError, match="unknown widget None"):
        reg.lookup(None)
    assert reg.get(None) is None and reg.get(["unhashable"]) is None
    with pytest.raises(ValueError, match=r"make_private: unknown engine 'vamp' \(did you mean "
                                         r"'vmap'\?\); valid engines: auto, compiled, ghost, naive, "):
        ENGINES.lookup("vamp", "make_private: ")
    with pytest.raises(ValueError, match=r"unknown engine 'gost' \(did you mean 'ghost'\?\)"):
        get_engine("gost")


@pytest.mark.parametrize("value, hint, expected", [
    ("1.5", float, 1.5), ("2", float, 2.0), (2, float, 2.0), ("3", int, 3), (" yes ", bool, True),
    ("off", bool, False), ("none", float | None, None), (None, int | None, None),
    ("0.5", float | None, 0.5), ("8,8", tuple[int, ...], (8, 8)), ([4, 2], tuple[int, ...], (4, 2)),
    ("(1, 4, 4)", tuple[int, ...] | None, (1, 4, 4)), ("64", tuple[int, ...], (64,)),
    (" tanh ", str, "tanh"), ("1,2", str | None, "1,2"), ("x", Any, "x"), (7, Any, 7),
])
def test_coerce_by_annotation(value: Any, hint: Any, expected: Any) -> None:
    out = coerce(value, hint, "p", "model 'm'")
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize("value, hint, message", [
    ("abc", float, r"^model 'm': option p='abc' is not a valid float$"),
    ("maybe", bool, r"^model 'm': option p='maybe' is not a valid bool$"),
    ("1.5", int, r"^model 'm': option p='1.5' is not a valid int$"),
    (2.5, int, r"^model 'm': option p=2.5 must be an int$"),
    (True, float, r"^model 'm': option p=True must be a float$"),
    (3, tuple[int, ...], r"must be a tuple, got 3 \(e\.g\. p=\(64, 64\)"),
    ("8,x", tuple[int, ...], r"option p='x' is not a valid int"),
])
def test_coerce_refuses_what_does_not_convert(value: Any, hint: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        coerce(value, hint, "p", "model 'm'")


def test_unknown_options_and_parameters_suggest_the_closest() -> None:
    """docs/errors.md entry 89."""
    with pytest.raises(ValueError, match=r"^model 'mlp' has no option\(s\) hiden \(did you mean "
                                         r"'hidden'\?\); valid options: activation, hidden, "):
        build_model("mlp", (4,), 2, hiden=3)
    with pytest.raises(ValueError, match=r"^strategy 'fixed' has no parameter\(s\) clipnorm \(did "
                                         r"you mean 'clip_norm'\?\); valid parameters: clip_norm"):
        make_strategy("fixed", {"clipnorm": "1"})
    with pytest.raises(ValueError, match=r"^dataset 'synthetic' has no option\(s\) ntrain "):
        DATASETS["synthetic"].coerce_options({"ntrain": "3"})


def test_string_parameters_convert_as_before() -> None:
    """The values the old converters produced (the refactor-invariance runs check the weights)."""
    assert make_strategy("fixed", {"clip_norm": "0.5"}).clip_norm == 0.5
    s = make_strategy("transfer", {"thresholds": "0.5,1.0"})
    assert s.thresholds == (0.5, 1.0)
    q = make_strategy("quantile", {"count_noise_std": "none"})
    assert q.count_noise_std is None
    with pytest.raises(ValueError, match=r"^strategy 'fixed': parameter clip_norm='big' is not a "
                                         r"valid float$"):
        make_strategy("fixed", {"clip_norm": "big"})
    m = build_model("mlp", (4,), 2, hidden="8,8", scale="none")
    assert [p.shape[0] for n, p in m.named_parameters() if n.endswith("weight")] == [8, 8, 2]


def test_evidence_module_points_to_the_train_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/errors.md entry 91: the harness no longer runs the CLI (no cli <-> harness circle)."""
    from dpclip.harness.evidence import main

    assert main(["out.json", "--", "train", "--dataset", "digits"]) == 2
    assert ("run `dpclip train --dataset digits --evidence out.json`"
            in capsys.readouterr().err)


def test_train_evidence_flag_appends_a_row(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from dpclip.cli import main

    monkeypatch.setenv("DPCLIP_OUT", str(tmp_path / "out"))
    out = tmp_path / "ev.json"
    argv = ["train", "--dataset", "digits", "--model", "logreg", "--epochs", "1",
            "--noise-multiplier", "1.0", "--batch-size", "256", "--db", str(tmp_path / "r.db"),
            "--no-progress", "--eval-every", "1", "--evidence", str(out)]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())
    assert row["dataset"] == "digits" and row["noise_multiplier_arg"] == 1.0
    assert row["command"].startswith("dpclip train --dataset digits") and "--evidence" not in \
        row["command"]
    assert out.with_suffix(".md").read_text().startswith("# ev")
