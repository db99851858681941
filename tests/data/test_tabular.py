"""Tabular UCI loaders on tiny synthetic files written in each dataset's standard format."""

from __future__ import annotations

import pytest
import torch

from dpclip.data import DatasetNotFoundError, load_dataset

ADULT_ROW = ("{age}, {wc}, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, "
             "{sex}, 2174, 0, 40, United-States, {y}")


def _adult(tmp_path):
    d = tmp_path / "adult"
    d.mkdir()
    rows = [ADULT_ROW.format(age=20 + i, wc=("State-gov", "?")[i % 2], sex=("Male", "Female")[i % 2],
                             y=("<=50K", ">50K")[i % 3 == 0]) for i in range(12)]
    (d / "adult.data").write_text("\n".join(rows) + "\n\n")
    test = ["|1x3 Cross validator"] + [r.replace("50K", "50K.") for r in rows[:4]]
    (d / "adult.test").write_text("\n".join(test) + "\n")
    return 12, 4, 2


def _german(tmp_path):
    rows = [f"A1{1 + i % 4} {6 + i} A3{i % 5} A4{i % 3} {1000 + 10 * i} A6{1 + i % 5} A7{1 + i % 5} "
            f"4 A9{1 + i % 4} A10{1 + i % 3} 4 A12{1 + i % 4} {30 + i} A14{1 + i % 3} A15{1 + i % 3} "
            f"2 A17{1 + i % 4} 1 A19{1 + i % 2} A20{1 + i % 2} {1 + i % 2}" for i in range(20)]
    (tmp_path / "german.data").write_text("\n".join(rows) + "\n")
    return 16, 4, 2


def _default(tmp_path):
    names = (["ID", "LIMIT_BAL", "SEX", "EDUCATION", "MARRIAGE", "AGE"]
             + [f"PAY_{k}" for k in (0, 2, 3, 4, 5, 6)] + [f"BILL_AMT{k}" for k in range(1, 7)]
             + [f"PAY_AMT{k}" for k in range(1, 7)] + ["default payment next month"])
    xrow = ",".join([""] + [f"X{k}" for k in range(1, 24)] + ["Y"])
    rows = [",".join(str(v) for v in [i + 1, 20000 * (i + 1), 1 + i % 2, 1 + i % 4, 1 + i % 3,
                                       24 + i] + [i % 3 - 1] * 6 + [100 * i] * 6 + [10 * i] * 6
                     + [i % 2]) for i in range(20)]
    (tmp_path / "default_of_credit_card_clients.csv").write_text(
        "\n".join([xrow, ",".join(names)] + rows) + "\n")
    return 16, 4, 2


def _nursery(tmp_path):
    classes = ["not_recom", "recommend", "very_recom", "priority", "spec_prior"]
    rows = [f"usual,proper,complete,{1 + i % 3},convenient,convenient,nonprob,"
            f"{('recommended', 'priority')[i % 2]},{classes[i % 5]}" for i in range(25)]
    (tmp_path / "nursery.data").write_text("\n".join(rows) + "\n")
    return 20, 5, 5


def _android(tmp_path):
    d = tmp_path / "android-permissions"
    d.mkdir()
    header = ",".join([f"android.permission.P{k}" for k in range(86)] + ["Class"])
    rows = [",".join(str((i + k) % 2) for k in range(86)) + f",{i % 2}" for i in range(10)]
    (d / "data.csv").write_text("\n".join([header] + rows) + "\n")
    return 8, 2, 2


def _dropout(tmp_path):
    d = tmp_path / "dropout"
    d.mkdir()
    header = ";".join(["Marital status", "Application mode"] + [f"f{k}" for k in range(34)]
                      + ["Target"])
    targets = ["Dropout", "Enrolled", "Graduate"]
    rows = [";".join([str(1 + i % 2), str(17)] + [f"{i * 0.5 + k}" for k in range(34)]
                     + [targets[i % 3]]) for i in range(15)]
    (d / "data.csv").write_text("\n".join([header] + rows) + "\n")
    return 12, 3, 3


CASES = {"adult": _adult, "german-credit": _german, "default-credit": _default,
         "nursery": _nursery, "android-permissions": _android, "dropout": _dropout}


@pytest.mark.parametrize("name", sorted(CASES))
def test_loader_reads_standard_file(name, tmp_path):
    n_train, n_test, classes = CASES[name](tmp_path)
    b = load_dataset(name, tmp_path, seed=0)
    assert b.num_classes == classes
    assert len(b.train.targets) == n_train and len(b.test.targets) == n_test
    assert b.train.inputs.dtype == torch.float32 and torch.isfinite(b.train.inputs).all()
    assert b.input_shape == (b.train.inputs.shape[1],)
    assert int(b.train.targets.max()) < classes
    # numeric columns are standardised on the train split
    assert float(b.train.inputs.mean(0).abs().max()) <= 1.0 + 1e-5


def test_encodings(tmp_path):
    _adult(tmp_path)
    b = load_dataset("adult", tmp_path)
    # 6 numeric + the declared categories of adult.names, each + "other" ("?" goes there):
    # workclass 8, education 16, marital 7, occupation 14, relationship 6, race 5, sex 2, country 41
    assert b.input_shape == (6 + 8 * 1 + 8 + 16 + 7 + 14 + 6 + 5 + 2 + 41,)
    assert b.test.targets.tolist() == [1, 0, 0, 1]  # trailing '.' stripped
    _german(tmp_path)
    g = load_dataset("german-credit", tmp_path)
    assert set(torch.cat([g.train.targets, g.test.targets]).tolist()) == {0, 1}


@pytest.mark.parametrize("name,file", [("adult", "adult.data"), ("german-credit", "german.data"),
                                       ("nursery", "nursery.data"), ("dropout", "data.csv")])
def test_missing_file_names_it(name, file, tmp_path, monkeypatch):
    monkeypatch.delenv("DPCLIP_DATA", raising=False)
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset(name, tmp_path)
    msg = str(info.value)
    assert file in msg and str(tmp_path) in msg and "archive.ics.uci.edu" in msg


def test_env_var_is_searched(tmp_path, monkeypatch):
    _nursery(tmp_path)
    monkeypatch.setenv("DPCLIP_DATA", str(tmp_path))
    assert load_dataset("nursery").num_classes == 5


def test_malformed_row_is_reported(tmp_path):
    (tmp_path / "nursery.data").write_text("usual,proper,priority\n")
    with pytest.raises(ValueError, match="fields"):
        load_dataset("nursery", tmp_path)


@pytest.mark.parametrize("name", sorted(CASES))
def test_default_scaling_is_declared_ranges(name, tmp_path):
    CASES[name](tmp_path)
    b = load_dataset(name, tmp_path, seed=0)
    assert b.preprocessing["scaling"] == "declared-ranges"
    assert b.preprocessing["nonprivate"] is False
    assert float(b.train.inputs.abs().max()) <= 1.0  # numeric in [-1, 1], one-hot in {0, 1}
    assert b.derived_from == (name,)


@pytest.mark.parametrize("scaling", [None, "train-statistics"])
def test_one_training_record_changes_no_other_record(scaling, tmp_path):
    """Default (declared ranges): editing one record changes that record only."""
    _german(tmp_path)
    path = tmp_path / "german.data"
    opts = {} if scaling is None else {"scaling": scaling}
    base = load_dataset("german-credit", tmp_path, seed=0, **opts)
    rows = path.read_text().splitlines()
    fields = rows[0].split()
    fields[1], fields[4] = "60", "15000"  # duration and credit amount of ONE record
    rows[0] = " ".join(fields)
    path.write_text("\n".join(rows) + "\n")
    other = load_dataset("german-credit", tmp_path, seed=0, **opts)
    changed = (base.train.inputs != other.train.inputs).any(dim=1)
    changed_test = (base.test.inputs != other.test.inputs).any(dim=1)
    n_changed = int(changed.sum()) + int(changed_test.sum())
    if scaling is None:
        assert n_changed == 1  # only the edited record
        assert other.preprocessing["nonprivate"] is False
    else:  # the NON-PRIVATE pipeline: one record moves every record's standardised features
        assert n_changed == len(base.train) + len(base.test)
        assert other.preprocessing["nonprivate"] is True


def test_declared_values_are_clipped_and_a_missing_range_is_refused(tmp_path, monkeypatch):
    import dataclasses

    from dpclip.data import tabular

    _german(tmp_path)
    path = tmp_path / "german.data"
    rows = path.read_text().splitlines()
    fields = rows[0].split()
    fields[4] = "1e9"  # a credit amount far above the declared bound: clipped to it
    rows[0] = " ".join(fields)
    path.write_text("\n".join(rows) + "\n")
    b = load_dataset("german-credit", tmp_path, seed=0)
    assert float(b.train.inputs.max()) <= 1.0 and float(b.test.inputs.max()) <= 1.0
    spec = tabular.TABULAR_SPECS["german-credit"]
    monkeypatch.setitem(tabular.TABULAR_SPECS, "german-credit",
                        dataclasses.replace(spec, ranges=spec.ranges[1:]))
    with pytest.raises(ValueError, match="no declared range"):
        load_dataset("german-credit", tmp_path, seed=0)
    with pytest.raises(ValueError, match="scaling must be one of"):
        load_dataset("nursery", tmp_path, scaling="zscore")


@pytest.mark.parametrize("name", ["nursery", "adult"])
def test_a_record_with_a_unique_category_changes_no_shape_and_no_other_record(name, tmp_path):
    """Categories come from the declaration, not from the private file (issue 33): one record
    with a value no other record has (Adult's single "Holand-Netherlands" row) used to add a
    one-hot column and shift every other record's columns."""
    from pathlib import Path

    from dpclip.data import tabular

    CASES[name](tmp_path)
    spec = tabular.TABULAR_SPECS[name]
    path = next(p for p in tmp_path.rglob(spec.files[0]))
    header, rows = tabular._read_rows(Path(path), spec)
    x0, y0, _, _ = tabular._encode(spec, Path(path), header, rows)
    odd = list(rows[0])
    col = 0 if name == "nursery" else 13  # parents / native-country
    odd[col] = "a-value-seen-once"
    x1, y1, _, _ = tabular._encode(spec, Path(path), header, rows + [odd])
    assert x1.shape[1] == x0.shape[1]
    assert (x1[:-1] == x0).all()  # every other record encoded exactly as before
    # the odd value lands in the column's "other" slot, as a "?" does
    numeric_before = 0 if name == "nursery" else 6  # adult: columns 0, 2, 4, 10, 11, 12
    start = sum(c.width for j, c in spec.categories if j < col) + numeric_before
    block = x1[-1, start:start + dict(spec.categories)[col].width]
    assert block.tolist() == [0.0] * (len(block) - 1) + [1.0]
    b = load_dataset(name, tmp_path, seed=0)
    assert b.input_shape == (x0.shape[1],)


def test_a_categorical_column_without_a_declared_list_is_refused(tmp_path, monkeypatch):
    import dataclasses

    from dpclip.data import tabular

    _nursery(tmp_path)
    spec = tabular.TABULAR_SPECS["nursery"]
    monkeypatch.setitem(tabular.TABULAR_SPECS, "nursery",
                        dataclasses.replace(spec, categories=spec.categories[1:]))
    with pytest.raises(ValueError, match=r"categorical column 0 of 'nursery' has no declared "
                                         r"category list; add it to TABULAR_SPECS"):
        load_dataset("nursery", tmp_path, seed=0)
