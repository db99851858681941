"""The generated evidence tables keep runs that differ only in their model options apart."""

from __future__ import annotations

from dpclip.harness.evidence import markdown_table


def _row(acc: float, **model_options: object) -> dict:
    return {"dataset": "fashion-mnist", "model": "lip-orth-cnn", "strategy": "lip-dp-sgd",
            "params": {"temperature": 0.1}, "epsilon": 3.0, "delta": 1e-5, "seed": 0,
            "epochs": 10, "test_accuracy": acc, "randomness": "secure",
            "model_options": model_options}


def test_model_options_are_shown_and_separate_the_settings() -> None:
    md = markdown_table([_row(0.75), _row(0.79, freeze_convs=True), _row(0.77)], "t")
    assert '| lip-orth-cnn {"freeze_convs": true} |' in md
    summary = md.split("## Mean and standard deviation per setting")[1]
    lines = [ln for ln in summary.splitlines() if ln.startswith("| fashion-mnist")]
    assert len(lines) == 2  # two settings, not one mean over all three runs
    assert "| 2 | 76.00 % |" in lines[0] and "| 1 | 79.00 % |" in lines[1]


def test_multiplicity_and_averaging_are_distinct_settings():
    from dpclip.harness.evidence import _model

    base = {"model": "cnn", "augment": "crop:4,flip"}
    assert _model(base) == "cnn augment crop:4,flip"
    assert _model(dict(base, augment_multiplicity=8, averaging="ema:0.999")) == \
        "cnn augment crop:4,flip x8 averaging ema:0.999"
