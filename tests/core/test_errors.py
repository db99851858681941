"""Bad inputs, as a new user would give them: each documented error of ``docs/errors.md`` has one
test here asserting its exact message (or a stable part of it) and that it comes BEFORE any
training. The doc's entries name these tests; keep the two in step.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dpclip.cli import main
from dpclip.data import DatasetBundle, DatasetNotFoundError, TensorSplit, load_dataset
from dpclip.data.cifar import CifarFormatError
from dpclip.data.idx import IDX_FILES, IdxFormatError
from dpclip.errors import BudgetWarning, NoiseWarning, did_you_mean
from dpclip.harness.spec import SpecError, load_spec
from dpclip.training.trainer import TrainConfig, describe_config_diff, train
from tests.data.test_idx import make_idx_dir

#: 128 examples, 32 per batch: 4 steps an epoch, a logistic regression (each run well under 2 s)
FAST = dict(dataset="synthetic", model="logreg", strategy="fixed",
            strategy_params={"clip_norm": 1.0}, dataset_options={"n_train": 128, "n_test": 32},
            delta=1e-5, epochs=1, batch_size=32, lr=0.5)
CLI = ["train", "--dataset", "synthetic", "--model", "logreg", "--delta", "1e-5", "--epochs", "1",
       "--batch-size", "32", "--lr", "0.5", "--no-progress", "--dataset-option", "n_train=128"]


def cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI; it must fail with exit status 2 and one ``dpclip CMD: error:`` line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"dpclip {argv[0]}: error: " in err
    return err


def bundle(x: torch.Tensor, y: torch.Tensor, num_classes: int = 2,
           input_shape: tuple[int, ...] | None = None) -> DatasetBundle:
    test = TensorSplit(torch.zeros(2, *x.shape[1:]), torch.zeros(2, dtype=torch.int64))
    return DatasetBundle("mine", TensorSplit(x, y), test, num_classes,
                         input_shape or tuple(x.shape[1:]), source="memory")


# -- CLI -------------------------------------------------------------------------------------------

def test_cli_data_dir_that_does_not_exist(capsys):
    err = cli_error(capsys, CLI + ["--noise-multiplier", "1", "--data-dir", "/nonexistent"])
    assert "--data-dir '/nonexistent': no such directory" in err
    assert "leave --data-dir out to search $DPCLIP_DATA" in err


def test_api_data_dir_without_the_files_does_not_fall_back(tmp_path, monkeypatch):
    make_idx_dir(tmp_path / "env" / "mnist", gz=False)  # valid data that must NOT be used
    monkeypatch.setenv("DPCLIP_DATA", str(tmp_path / "env"))
    (tmp_path / "empty").mkdir()
    assert len(load_dataset("mnist").train) == 5  # the environment works when nothing is given
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("mnist", data_dir=tmp_path / "empty")
    msg = str(info.value)
    assert f"not found in the data directory you gave, '{tmp_path / 'empty'}'" in msg
    assert "$DPCLIP_DATA and the system directories were not searched" in msg
    assert f"{tmp_path / 'empty'} (missing: train-images-idx3-ubyte[.gz]" in msg
    assert str(tmp_path / "env") not in msg


def test_api_cifar_data_dir_does_not_fall_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DPCLIP_DATA", str(tmp_path / "env"))
    with pytest.raises(DatasetNotFoundError, match="given explicitly, so \\$DPCLIP_DATA") as info:
        load_dataset("cifar10", data_dir=tmp_path)
    assert str(tmp_path / "env") not in str(info.value)
    assert "download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in str(info.value)


def test_cli_zero_steps_in_budget_is_an_error_before_training(capsys):
    err = cli_error(capsys, CLI + ["--epsilon", "0.1", "--noise-multiplier", "1"])
    assert "--epsilon 0.1 with --noise-multiplier 1 allows 0 of the 4 planned steps: a single " \
           "step (sample rate 0.25) already costs epsilon" in err
    assert "Raise --epsilon above" in err and "fits all 4 steps in epsilon 0.1" in err
    assert "epoch" not in capsys.readouterr().out  # nothing trained


def test_budget_ending_early_warns_with_the_fraction():
    cfg = TrainConfig(**dict(FAST, epochs=2), noise_multiplier=2.0, epsilon=1.5)
    with pytest.warns(BudgetWarning, match=r"allows only 5 of the 8 planned steps \(62%, 1.25 "
                                           r"of 2 epochs\): training stops early"):
        s = train(cfg, progress=False).summary
    assert s["steps"] == 5 and s["stopped_by_budget"]


def test_cli_prints_budget_warning_as_a_warning_line(capsys):
    assert main(CLI + ["--epochs", "2", "--epsilon", "1.5", "--noise-multiplier", "2",
                       "--json"]) == 0
    err = capsys.readouterr().err
    assert "dpclip train: warning: --epsilon 1.5 with --noise-multiplier 2 allows only 5 of " \
           "the 8 planned steps" in err


def test_delta_at_least_one_over_n_is_an_error():
    cfg = TrainConfig(**dict(FAST, delta=0.01), noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"delta=0.01 \(--delta\) is >= 1/N = 1/128 \(128 private "
                                         r"training examples\): a mechanism that publishes one "
                                         r"random record"):
        train(cfg, progress=False)


def test_delta_counts_private_examples_only():
    params = {"clip_norm": 1.0, "public_fraction": 0.5}
    cfg = TrainConfig(**dict(FAST, delta=0.02, strategy_params=params), noise_multiplier=1.0)
    # (the public split decides each example on its own since review 206: about half are public)
    with pytest.raises(ValueError, match=r"1/N = 1/(\d+) \((\d+) private training examples \(128 "
                                         r"minus the public split\)\).*e\.g\. 1e-05") as err:
        train(cfg, progress=False)
    import re

    n = re.search(r"1/N = 1/(\d+) \((\d+) private", str(err.value))
    assert n.group(1) == n.group(2) and 40 <= int(n.group(1)) <= 88


def test_cli_delta_too_large(capsys):
    err = cli_error(capsys, ["train", "--dataset", "breast-cancer", "--model", "mlp",
                             "--epsilon", "1", "--delta", "0.01", "--epochs", "1",
                             "--batch-size", "64", "--lr", "0.1", "--no-progress"])
    assert "delta=0.01 (--delta) is >= 1/N = 1/455 (455 private training examples)" in err
    assert "use delta < 1/N, e.g. 1e-05" in err


def test_huge_noise_multiplier_warns():
    cfg = TrainConfig(**FAST, noise_multiplier=1000.0)
    with pytest.warns(NoiseWarning, match=r"noise multiplier 1,000 \(given as --noise-multiplier "
                                          r"1000\) is so large that the model will not learn: "
                                          r"the noise on each coordinate of the averaged gradient "
                                          r"has std 31.25 x the clip norm"):
        train(cfg, progress=False)


def test_tiny_epsilon_warns_with_the_calibrated_sigma():
    cfg = TrainConfig(**FAST, epsilon=0.02)
    with pytest.warns(NoiseWarning, match=r"\(calibrated for --epsilon 0.02 at delta 1e-05\) "
                                          r"is so large"):
        z = train(cfg, progress=False).summary["noise_multiplier"]
    assert z > 50


def test_moderate_noise_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseWarning)
        train(TrainConfig(**FAST, noise_multiplier=5.0), progress=False)


def test_python_dash_m_dpclip_runs_the_cli():
    env = dict(os.environ, DPCLIP_ALLOCATOR="system")
    out = subprocess.run([sys.executable, "-m", "dpclip", "epsilon", "--sample-rate", "0.01",
                          "--noise-multiplier", "1", "--steps", "100", "--delta", "1e-5"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("epsilon = 0.71")


def test_absl_warnings_of_the_rdp_accountant_do_not_reach_the_user(caplog, capfd):
    from dpclip.accounting import compute_epsilon
    from dpclip.accounting.accountants import _rdp_curve
    from dpclip.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent

    _rdp_curve.cache_clear()  # the warnings come from computing a curve, which is cached
    caplog.set_level(logging.DEBUG)
    event = SelfComposedEvent(PoissonSampledEvent(0.140659, GaussianEvent(1.0)), 14)
    eps = compute_epsilon(event, 1e-5, accountant="rdp").epsilon
    assert 0 < eps < float("inf")
    assert not [r for r in caplog.records if r.name == "absl"]
    assert "failed to converge" not in capfd.readouterr().err
    # the filter is scoped to the call: absl's own logger works again afterwards
    caplog.set_level(logging.DEBUG, logger="absl")  # another test may have raised its level
    logging.getLogger("absl").warning("still here")
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == ["still here"]


def test_cli_unknown_dataset_suggests(capsys):
    argv = [a if a != "synthetic" else "fashion_mnist" for a in CLI]
    err = cli_error(capsys, argv + ["--noise-multiplier", "1"])
    assert "--dataset: unknown dataset 'fashion_mnist' (did you mean 'fashion-mnist'?); valid " \
           "datasets: adult," in err


def test_cli_param_without_equals(capsys):
    with pytest.raises(SystemExit, match="--param expects key=value, got 'clip_norm'"):
        main(CLI + ["--noise-multiplier", "1", "--param", "clip_norm"])


def test_cli_no_privacy_level(capsys):
    err = cli_error(capsys, CLI)
    assert "give a target epsilon (--epsilon) or a noise multiplier (--noise-multiplier)" in err


# -- Python API: TrainConfig ----------------------------------------------------------------------

@pytest.mark.parametrize("field,value,expected", [
    ("model", "mpl", "unknown model 'mpl' (did you mean 'mlp'?); valid models: "),
    ("strategy", "fixd", "unknown strategy 'fixd' (did you mean 'fixed'?); valid strategies: "),
    ("optimizer", "adamw", "unknown optimizer 'adamw' (did you mean 'adam'?); valid optimizers: "
                           "adam, momentum, sgd"),
    ("sampling", "poison", "unknown sampling 'poison' (did you mean 'poisson'?); valid samplings: "
                           "fixed-size, poisson"),
    ("accountant", "rpd", "unknown accountant 'rpd' (did you mean 'rdp'"),
    ("engine", "vamp", "unknown engine 'vamp' (did you mean 'vmap'?); valid engines: auto, "),
])
def test_unknown_names_suggest(field, value, expected):
    with pytest.raises(ValueError) as info:
        TrainConfig(**dict(FAST, **{field: value}), noise_multiplier=1.0)
    assert expected in str(info.value)


@pytest.mark.parametrize("field,value,expected", [
    ("lr", "0.1", "lr (--lr) must be a number, got str '0.1' (in a TOML spec, write numbers "
                  "without quotes)"),
    ("epochs", 2.5, "epochs (--epochs) must be an integer, got float 2.5"),
    ("batch_size", True, "batch_size (--batch-size) must be a number, got bool True"),
    ("strategy_params", "clip_norm=1", "strategy_params (--param) must be a table / dict, got "
                                       "str"),
    ("weight_decay", -0.1, "TrainConfig: weight_decay must be >= 0, got -0.1"),
    ("max_physical_batch", 0, "max_physical_batch (--max-physical-batch) must be >= 1, got 0"),
])
def test_wrong_types_and_ranges(field, value, expected):
    with pytest.raises(ValueError) as info:
        TrainConfig(**dict(FAST, **{field: value}), noise_multiplier=1.0)
    assert expected in str(info.value)


def test_did_you_mean_is_empty_when_nothing_is_close():
    assert did_you_mean("zzzz", ["mlp", "logreg"]) == ""


# -- Python API: user-supplied data ----------------------------------------------------------------

def test_inputs_and_targets_of_different_lengths():
    with pytest.raises(ValueError, match=r"TensorSplit inputs and targets disagree on the number "
                                         r"of examples: inputs \(10, 3\), targets \(9,\)"):
        TensorSplit(torch.randn(10, 3), torch.zeros(9, dtype=torch.int64))


def test_labels_outside_the_classes():
    y = torch.tensor([0, 1, 1, 2, 0, 1])
    with pytest.raises(ValueError, match=r"dataset 'mine': train targets must lie in \[0, 2\) "
                                         r"\(class indices, num_classes=2\), got range \[0, 2\] "
                                         r"\(first bad example: index 3, label 2\)"):
        bundle(torch.randn(6, 3), y)


def test_float_labels():
    with pytest.raises(ValueError, match="TensorSplit.targets must be int64 class indices, got "
                                         "torch.float32; convert with targets.long()"):
        TensorSplit(torch.randn(4, 3), torch.zeros(4))


def test_nan_inputs_name_the_split_and_first_index():
    x = torch.randn(10, 3)
    x[4, 1] = float("nan")
    x[7, 0] = float("inf")
    with pytest.raises(ValueError, match=r"dataset 'mine': train inputs contain non-finite values "
                                         r"\(nan\) in 2 example\(s\), the first at index 4; remove "
                                         r"or impute them"):
        bundle(x, torch.zeros(10, dtype=torch.int64))


def test_inputs_not_of_the_declared_shape():
    with pytest.raises(ValueError, match=r"dataset 'mine': train examples have shape \(3,\), "
                                         r"expected input_shape \(4,\)"):
        bundle(torch.randn(6, 3), torch.zeros(6, dtype=torch.int64), input_shape=(4,))


def test_data_that_is_not_a_bundle():
    cfg = TrainConfig(**FAST, noise_multiplier=1.0)
    with pytest.raises(TypeError, match="data must be a dpclip.data.DatasetBundle, got tuple; "
                                        "build one with DatasetBundle"):
        train(cfg, data=(torch.randn(8, 20), torch.zeros(8, dtype=torch.int64)), progress=False)


# -- corrupt files ---------------------------------------------------------------------------------

def test_truncated_idx_file_names_the_file_and_how_to_get_it(tmp_path):
    make_idx_dir(tmp_path, gz=False)
    bad = tmp_path / IDX_FILES["train_images"]
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(IdxFormatError) as info:
        load_dataset("fashion-mnist", data_dir=tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"{bad}: payload has")
    assert "the file is truncated or corrupted" in msg
    assert f"The fashion-mnist files in {tmp_path} cannot be used; get them again: on " \
           "Debian/Ubuntu: `apt-get install dataset-fashion-mnist`" in msg


def test_garbage_idx_file(tmp_path, capsys):
    make_idx_dir(tmp_path, gz=False)
    bad = tmp_path / IDX_FILES["test_labels"]
    bad.write_bytes(b"<html>404 Not Found</html>")
    err = cli_error(capsys, ["train", "--dataset", "mnist", "--model", "logreg", "--data-dir",
                             str(tmp_path), "--noise-multiplier", "1", "--delta", "1e-5",
                             "--epochs", "1", "--batch-size", "2", "--lr", "0.1", "--no-progress"])
    assert f"{bad}: not an IDX file (magic number 3c68746d" in err
    assert "get them again: download the four files from the original MNIST site" in err


def test_corrupt_cifar_archive(tmp_path):
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"\x1f\x8b\x08\x00garbage" * 10)
    with pytest.raises(CifarFormatError, match="cifar-10-python.tar.gz: corrupted or truncated "
                                               "archive .*; delete it and download https://"):
        load_dataset("cifar10", data_dir=tmp_path)


# -- TOML specs ------------------------------------------------------------------------------------

SPEC = """
name = "t"
[train]
dataset = "synthetic"
model = "logreg"
epochs = 1
batch_size = 32
lr = 0.5
[grid]
noise_multipliers = [1.0]
[[strategies]]
name = "fixed"
params = { clip_norm = 1.0 }
"""


def spec_error(tmp_path: Path, text: str) -> str:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: ")  # every spec error names the file
    return msg[len(f"{p}: "):]


def test_spec_is_valid_as_written(tmp_path):
    p = tmp_path / "ok.toml"
    p.write_text(SPEC)
    assert len(load_spec(p).runs()) == 1


def test_spec_unknown_top_level_key(tmp_path):
    msg = spec_error(tmp_path, SPEC.replace("[[strategies]]", "[[strategy]]"))
    assert msg.startswith("top level: unknown key(s) ['strategy'] (did you mean 'strategies'?); "
                          "valid: ['claims', 'description', 'federated', 'grid', 'name', 'paper', "
                          "'published', 'strategies', 'train', 'tuning']")


def test_spec_unknown_train_field(tmp_path):
    msg = spec_error(tmp_path, SPEC.replace("epochs = 1", "epoch = 1"))
    assert msg.startswith("[train]: unknown field(s) ['epoch'] (did you mean 'epochs'?); valid: ")


def test_spec_value_of_the_wrong_type(tmp_path):
    msg = spec_error(tmp_path, SPEC.replace("epochs = 1", 'epochs = "1"'))
    assert msg == ("[train]: TrainConfig: epochs (--epochs) must be an integer, got str '1' (in a "
                   "TOML spec, write numbers without quotes)")


def test_spec_section_that_is_not_a_table(tmp_path):
    text = SPEC.replace("[grid]\nnoise_multipliers = [1.0]\n", "").replace(
        'name = "t"', 'name = "t"\ngrid = 3')
    assert spec_error(tmp_path, text) == ("grid must be a table ([grid] or grid = { ... }), got "
                                          "int 3")


def test_spec_missing_strategies(tmp_path):
    text = SPEC.split("[[strategies]]")[0]
    assert spec_error(tmp_path, text) == "the spec needs at least one [[strategies]] entry"


def test_spec_missing_privacy_level(tmp_path):
    msg = spec_error(tmp_path, SPEC.replace("noise_multipliers = [1.0]", "seeds = [0]"))
    assert msg == "[grid] needs exactly one of `epsilons` or `noise_multipliers`"


def test_spec_unknown_strategy_name(tmp_path):
    msg = spec_error(tmp_path, SPEC.replace('name = "fixed"', 'name = "fixd"'))
    assert msg.startswith("[[strategies]] 'fixd': unknown strategy 'fixd' (did you mean "
                          "'fixed'?); valid strategies: ")


def test_spec_unknown_model_name(tmp_path):
    msg = spec_error(tmp_path, SPEC.replace('model = "logreg"', 'model = "log-reg"'))
    assert msg.startswith("[grid] models / [train] model: unknown model 'log-reg' (did you mean "
                          "'logreg'?)")


def test_spec_invalid_toml(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(SPEC.replace("epochs = 1", "epochs = "))
    with pytest.raises(SpecError, match=f"^{p}: invalid TOML: "):
        load_spec(p)


# -- checkpoints -----------------------------------------------------------------------------------

def test_describe_config_diff_lists_changed_fields():
    a = TrainConfig(**FAST, noise_multiplier=1.0).to_dict()
    b = TrainConfig(**dict(FAST, lr=0.1, strategy_params={"clip_norm": 2.0}),
                    noise_multiplier=1.0, device="auto").to_dict()
    assert describe_config_diff(a, b) == "lr: 0.5 -> 0.1; strategy_params.clip_norm: 1.0 -> 2.0"
    assert describe_config_diff(a, a) == "(no field differs)"


def test_changed_config_on_resume_lists_the_fields(tmp_path):
    cfg = TrainConfig(**dict(FAST, epochs=2), noise_multiplier=1.0)
    assert train(cfg, checkpoint_dir=tmp_path, progress=False,
                 stop_after_steps=2).summary["interrupted"]
    changed = dataclasses.replace(cfg, lr=0.1, epochs=3)
    with pytest.raises(ValueError, match=r"belongs to a different run configuration \(changed: "
                                         r"epochs: 2 -> 3; lr: 0.5 -> 0.1\); use another "
                                         r"--checkpoint-dir or delete it"):
        train(changed, checkpoint_dir=tmp_path, progress=False)


def test_full_disk_when_checkpointing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = TrainConfig(**dict(FAST, epochs=2), noise_multiplier=1.0)
    train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=4)
    ck = tmp_path / "checkpoint.pt"
    before = ck.read_bytes()
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # writes part of the file, then the disk is full
        Path(f).write_bytes(b"\x80\x02partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError) as info:
        train(cfg, checkpoint_dir=tmp_path, progress=False)
    assert info.value.errno == errno.ENOSPC
    msg = str(info.value)
    assert f"could not write checkpoint {ck}" in msg and "No space left on device" in msg
    assert f"the previous checkpoint {ck} is intact" in msg and "--checkpoint-dir" in msg
    assert ck.read_bytes() == before  # the last good checkpoint was not touched
    assert not ck.with_suffix(".tmp").exists()  # no half-written file left behind
    monkeypatch.setattr(torch, "save", real_save)
    assert train(cfg, checkpoint_dir=tmp_path, progress=False).summary["steps"] == 8


def test_epsilon_command_bad_sample_rate(capsys):
    with pytest.raises(SystemExit, match=r"--sample-rate must be in \(0, 1\], got 2.0"):
        main(["epsilon", "--sample-rate", "2", "--noise-multiplier", "1", "--steps", "10",
              "--delta", "1e-5"])


def test_numpy_integers_are_refused_with_the_fix():
    # the config is stored as JSON: a numpy integer would fail later, in the fingerprint
    with pytest.raises(ValueError,
                       match=r"epochs \(--epochs\) must be an integer, got int64 np.int64\(2\)"):
        TrainConfig(**dict(FAST, epochs=np.int64(2)), noise_multiplier=1.0)


# -- augmentation ----------------------------------------------------------------------------------

def test_cli_augment_without_padding(capsys):
    err = cli_error(capsys, CLI + ["--noise-multiplier", "1", "--augment", "crop"])
    assert ("TrainConfig: augment (--augment): 'crop' must be 'crop:P' with an integer padding "
            "P >= 1 (or 'crop:P:reflect'), e.g. 'crop:4'") in err


def test_cli_augment_of_non_images(capsys, tmp_path):
    err = cli_error(capsys, CLI + ["--noise-multiplier", "1", "--augment", "flip",
                                   "--db", str(tmp_path / "r.db")])
    assert ("--augment: augmentation 'flip' needs image inputs of shape (C, H, W) per example, "
            "got per-example shape (20,). Set it to 'none' for non-image data") in err


# ------------------------------------------------------------------ devices (issue 32, 101-107)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cli_device_cuda_without_cuda(capsys, tmp_path):
    err = cli_error(capsys, CLI + ["--noise-multiplier", "1", "--device", "cuda",
                                   "--db", str(tmp_path / "r.db")])
    assert ("--device cuda: this torch build or machine has no CUDA device; use --device cpu, "
            "or --device auto to take CUDA only where it is present") in err


def test_cli_eval_every_negative(capsys):
    err = cli_error(capsys, CLI + ["--noise-multiplier", "1", "--eval-every", "-1"])
    assert ("TrainConfig: eval_every (--eval-every) must be >= 0 (0: evaluate only at the end), "
            "got -1") in err
def test_cli_augment_multiplicity_without_augmentation(capsys):
    err = cli_error(capsys, CLI + ["--noise-multiplier", "1", "--augment-multiplicity", "4"])
    assert ("TrainConfig: augment_multiplicity (--augment-multiplicity) = 4 averages the gradients "
            "of K AUGMENTED copies of each example, but augment is 'none'; set --augment (e.g. "
            "crop:4,flip) or use K = 1") in err


def test_cli_augment_multiplicity_on_the_summed_engine(capsys, tmp_path):
    # (the ghost engine was refused here before issue 36: it now reads the K copies' rows)
    argv = ["train", "--dataset", "synthetic", "--model", "mlp", "--delta", "1e-5", "--epochs",
            "1", "--batch-size", "32", "--no-progress", "--noise-multiplier", "1",
            "--dataset-option", "n_train=128", "--dataset-option", "image_shape=1,6,6",
            "--augment", "flip", "--augment-multiplicity", "2", "--engine", "summed",
            "--db", str(tmp_path / "r.db")]
    err = cli_error(capsys, argv)
    assert ("--augment-multiplicity=2: the summed engine does not clip per example; use engine "
            "'auto', 'ghost' or 'vmap'") in err


def test_cli_bad_averaging(capsys):
    err = cli_error(capsys, CLI + ["--noise-multiplier", "1", "--averaging", "ema:1.5"])
    assert ("TrainConfig: averaging (--averaging): 'ema:1.5': the EMA decay must be in (0, 1), "
            "e.g. 'ema:0.999'") in err


def test_cli_unit_given_twice(capsys):
    err = cli_error(capsys, CLI + ["--noise-multiplier", "1", "--unit", "bc", "--param",
                                   "unit=gbc"])
    assert ("TrainConfig: unit is given twice, 'bc' as its own argument (unit='bc' (CLI --unit "
            "bc; spec [train] unit = \"bc\")) and 'gbc' inside the strategy's parameters (the old "
            "spelling); remove it from the strategy's parameters") in err


def test_cli_old_unit_spelling_is_a_warning(capsys):
    assert main(CLI + ["--noise-multiplier", "1", "--param", "unit=bc", "--json"]) == 0
    err = capsys.readouterr().err
    assert ("dpclip train: warning: TrainConfig: the clipping unit setting unit='bc' inside the "
            "strategy's parameters is deprecated; give it as its own argument: unit='bc' (CLI "
            "--unit bc; spec [train] unit = \"bc\")") in err


def test_instance_norm_with_running_statistics_under_per_example_clipping():
    """errors.md 135: refused when make_private is called, naming the layer and the fix (before,
    the engine's proof refused the first step with a message that named no cause)."""
    import dpclip
    from torch import nn

    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.InstanceNorm1d(3, track_running_stats=True),
                          nn.Flatten(), nn.Linear(18, 2))
    x, y = torch.randn(32, 2, 8), torch.randint(0, 2, (32,))
    with pytest.raises(ValueError, match=r"the model has InstanceNorm layer '1' with "
                                         r"track_running_stats=True: .* Build it with "
                                         r"track_running_stats=False"):
        dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                            batch_size=8, steps=1, noise_multiplier=1.0, verbose=False)
    ok = nn.Sequential(nn.Conv1d(2, 3, 3), nn.InstanceNorm1d(3), nn.Flatten(), nn.Linear(18, 2))
    dpclip.make_private(ok, torch.optim.SGD(ok.parameters(), lr=0.1), (x, y), batch_size=8,
                        steps=1, noise_multiplier=1.0, verbose=False)


def test_spectral_norm_vectors_updated_in_the_step_name_the_fix():
    """errors.md 137: spectral normalisation's power-iteration buffers, updated at every
    training-mode forward (once per chunk: they would count the chunks), are refused with a fix
    that works: the layer in eval mode for the private step, its vectors refreshed between steps."""
    import dpclip
    from dpclip.engine.errors import PrivateBufferError
    from torch import nn

    def run(fix: bool) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(),
                              nn.utils.parametrizations.spectral_norm(nn.Linear(16, 8)),
                              nn.Tanh(), nn.Linear(8, 2))
        x, y = torch.randn(64, 2, 8), torch.randint(0, 2, (64,))
        dp = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                                 batch_size=16, steps=2, noise_multiplier=1.0, verbose=False)
        for xb, yb in dp.loader:
            if fix:
                model[1].eval()  # the documented fix
            dp.step(xb, yb)
            if fix:
                with torch.no_grad():
                    model[1].train()
                    model[1](torch.randn(4, 16))  # (public data: refreshes _u and _v)
                    model[1].eval()

    with pytest.raises(PrivateBufferError, match=r"spectral normalisation updates its "
                                                 r"power-iteration vectors .* Fix: put the "
                                                 r"spectral-normalised layers in eval mode"):
        run(fix=False)
    run(fix=True)
