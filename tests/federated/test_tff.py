"""The TFF federated files (EMNIST, Shakespeare, Stack Overflow): readers, TFF's tokenisation,
the benchmark models, and a few DP-FedAvg rounds on tiny files written in the official layout
(``examples/<client_id>/<feature>``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpclip.data import DatasetNotFoundError
from dpclip.federated import evaluate, run_fedavg
from dpclip.federated.models import build_federated_model
from dpclip.federated.spec import build_run
from dpclip.federated.tff import (
    CHAR_VOCAB,
    find_tff_files,
    load_tff,
    read_clients,
    shakespeare_tokens,
    stackoverflow_tokens,
)

h5py = pytest.importorskip("h5py")


def write_h5(path, clients: dict[str, dict[str, np.ndarray]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        ex = f.create_group("examples")
        for cid, feats in clients.items():
            g = ex.create_group(cid)
            for k, v in feats.items():
                if v.dtype == object:
                    g.create_dataset(k, data=v, dtype=h5py.string_dtype())
                else:
                    g.create_dataset(k, data=v)


def test_missing_files_name_what_to_fetch_and_from_where(tmp_path, monkeypatch):
    monkeypatch.delenv("DPCLIP_DATA", raising=False)
    with pytest.raises(DatasetNotFoundError) as err:
        find_tff_files("emnist-fed", tmp_path)
    msg = str(err.value)
    assert "fed_emnist_train.h5" in msg and "fed_emnist.tar.bz2" in msg and str(tmp_path) in msg
    for name, needle in (("shakespeare", "shakespeare_train.h5"),
                         ("stackoverflow", "stackoverflow.tar.bz2"),
                         ("emnist-digits-fed", "fed_emnist_digitsonly.tar.bz2")):
        with pytest.raises(DatasetNotFoundError, match=needle):
            find_tff_files(name, tmp_path)
    with pytest.raises(DatasetNotFoundError, match="stackoverflow_held_out.h5"):
        find_tff_files("stackoverflow", tmp_path, ("held_out",))
    (tmp_path / "emnist").mkdir()
    for f in ("fed_emnist_train.h5", "fed_emnist_test.h5"):
        (tmp_path / "emnist" / f).write_bytes(b"")
    assert find_tff_files("emnist-fed", tmp_path)["train"].parent.name == "emnist"
    with pytest.raises(ValueError, match="splits: train, test"):
        find_tff_files("emnist-fed", tmp_path, ("held_out",))


def test_shakespeare_tokens_follow_tff_char_vocab():
    # TFF: 86 characters -> 1..86, oov 87, bos 88, eos 89, pad 0 (VOCAB_LENGTH = 86 + 4)
    assert len(CHAR_VOCAB) == 86 and CHAR_VOCAB[0] == "d" and CHAR_VOCAB[-1] == "\r"
    rows = shakespeare_tokens([b"dh~"], sequence_length=3)
    assert rows.tolist() == [[88, 1, 2, 87], [89, 0, 0, 0]]
    rows = shakespeare_tokens([b"\r", "d"], sequence_length=2)
    assert rows.tolist() == [[88, 86, 89], [88, 1, 89]]


def test_stackoverflow_tokens_follow_tff_word_prediction():
    vocab = ["the", "a", "is"]  # V = 3: words 1..3, oov 4, bos 5, eos 6, pad 0
    rows = stackoverflow_tokens([b"the cat is", "a", "is is is is is"], vocab, sequence_length=3)
    assert rows.tolist() == [[5, 1, 4, 3], [5, 2, 6, 0], [5, 3, 3, 3]]


def test_evaluate_skips_padding_targets():
    class Const(torch.nn.Module):  # always predicts token 2
        def forward(self, x):
            out = torch.zeros(x.shape[0], 5, x.shape[1])
            out[:, 2] = 10.0
            return out

    y = torch.tensor([[2, 3, 0, 0], [2, 2, 2, 0]])
    acc, _ = evaluate(Const(), torch.zeros_like(y), y, ignore_index=0)
    assert acc == pytest.approx(4 / 5)  # 5 non-pad targets, 4 of them are 2
    acc_all, _ = evaluate(Const(), torch.zeros_like(y), y)
    assert acc_all == pytest.approx(4 / 8)


def _emnist(tmp_path, n_clients=12, per=10):
    rng = np.random.default_rng(0)

    def client(k):
        y = rng.integers(0, 2, size=per).astype(np.int32)
        x = np.ones((per, 28, 28), dtype=np.float32)  # TFF: background 1.0
        x[y == 1, 4:24, 10:18] = 0.0                 # label 1: a dark bar
        x += rng.normal(0, 0.05, x.shape).astype(np.float32)
        return {"pixels": x, "label": y}

    ids = [f"f{k:04d}_{k:02d}" for k in range(n_clients)]
    write_h5(tmp_path / "emnist" / "fed_emnist_digitsonly_train.h5", {c: client(0) for c in ids})
    write_h5(tmp_path / "emnist" / "fed_emnist_digitsonly_test.h5",
             {c: client(0) for c in ids})
    return ids


def test_emnist_users_are_the_clients_and_train(tmp_path):
    ids = _emnist(tmp_path)
    fd = load_tff("emnist-digits-fed", tmp_path, num_users=8, seed=3)
    assert fd.num_users == 8 and set(fd.user_sizes()) == {10} and fd.num_classes == 10
    assert fd.users[0].inputs.shape == (10, 1, 28, 28) and len(fd.test) == 80
    raw = read_clients(tmp_path / "emnist" / "fed_emnist_digitsonly_train.h5",
                       ["pixels", "label"], ids[:1])
    assert raw[ids[0]]["pixels"].shape == (10, 28, 28)
    spec = {"dataset": "emnist-digits-fed", "data_dir": str(tmp_path), "num_users": 12,
            "model": "emnist-cnn", "model_options": {"channels": [4, 8], "hidden": 16},
            "rounds": 4, "clients_per_round": 6, "delta": 1e-3, "noise_multiplier": 0.3,
            "strategy": "quantile", "params": {"initial_clip_norm": 0.5, "count_noise_std": 1.0},
            "local_batch_size": 5, "client_lr": 0.1, "server_lr": 1.0, "eval_every": 4,
            "reproducible_noise": True}
    data, model, strategy, config = build_run(spec)
    assert data.describe()["partition"] == "natural (TFF clients)"
    loss0 = evaluate(model, data.test.inputs, data.test.targets)[1]
    res = run_fedavg(data, model, strategy, config)
    assert res.ledger.steps == 4 and res.epsilon > 0
    assert res.history[-1]["test_loss"] < loss0  # it trained
    with pytest.raises(ValueError, match="federated already"):
        build_run({**spec, "partition": "iid"})
    with pytest.raises(ValueError, match=r"dataset_options \['n_train'\] do not apply"):
        build_run({**spec, "dataset_options": {"n_train": 5}})


def test_shakespeare_next_character_task_trains(tmp_path):
    snippets = ["To be, or not to be: that is the question.", "Whether 'tis nobler in the mind",
                "to suffer the slings and arrows of outrageous fortune,"]
    clients = {f"THE_TRAGEDY_{k}": {"snippets": np.array([s.encode() for s in snippets[k % 3:]],
                                                          dtype=object)} for k in range(6)}
    write_h5(tmp_path / "shakespeare" / "shakespeare_train.h5", clients)
    write_h5(tmp_path / "shakespeare" / "shakespeare_test.h5", clients)
    spec = {"dataset": "shakespeare", "data_dir": str(tmp_path),
            "dataset_options": {"sequence_length": 20}, "model": "char-lstm",
            "model_options": {"embed": 4, "hidden": 16, "layers": 1}, "rounds": 3,
            "clients_per_round": 3, "delta": 1e-3, "noise_multiplier": 0.3,
            "strategy": "fixed", "params": {"clip_norm": 1.0}, "local_batch_size": 4,
            "client_lr": 0.5, "eval_every": 3, "reproducible_noise": True}
    data, model, strategy, config = build_run(spec)
    assert data.num_classes == 90 and data.input_shape == (20,) and data.ignore_index == 0
    x, y = data.users[0].inputs, data.users[0].targets
    assert torch.equal(x[:, 1:], y[:, :-1]) and x[0, 0] == 88  # shifted by one, starts with bos
    assert model(x[:2]).shape == (2, 90, 20)
    res = run_fedavg(data, model, strategy, config)
    assert res.ledger.steps == 3 and 0 <= res.summary["test_accuracy"] <= 1


def test_stackoverflow_next_word_task_and_missing_word_counts(tmp_path, monkeypatch):
    monkeypatch.delenv("DPCLIP_DATA", raising=False)
    texts = ["how do i sort a list in python", "what is a pointer", "i use git rebase"]
    clients = {str(100 + k): {"tokens": np.array([t.encode() for t in texts], dtype=object),
                              "tags": np.array([b"python|sorting"] * 3, dtype=object)}
               for k in range(5)}
    d = tmp_path / "stackoverflow"
    write_h5(d / "stackoverflow_train.h5", clients)
    write_h5(d / "stackoverflow_test.h5",
             {str(900 + i): v for i, v in enumerate(clients.values())})
    write_h5(d / "stackoverflow_held_out.h5", clients)
    spec = {"dataset": "stackoverflow", "data_dir": str(tmp_path), "num_users": 4,
            "dataset_options": {"sequence_length": 6, "vocab_size": 5}, "model": "word-lstm",
            "model_options": {"embed": 4, "hidden": 8, "projection": 4}, "rounds": 2,
            "clients_per_round": 2, "delta": 1e-3, "noise_multiplier": 0.3, "strategy": "fixed",
            "params": {"clip_norm": 1.0}, "eval_every": 2, "reproducible_noise": True}
    with pytest.raises(DatasetNotFoundError, match="stackoverflow.word_count.tar.bz2"):
        build_run(spec)
    (d / "stackoverflow.word_count").write_text("i 40\na 30\nis 20\nhow 10\nwhat 9\npython 8\n")
    data, model, strategy, config = build_run(spec)
    assert data.num_classes == 5 + 4 and data.num_users == 4 and len(data.test) == 12
    # V = 5 (i a is how what): oov 6, bos 7, eos 8; "what is a pointer" -> inputs
    # bos what is a oov eos, targets what is a oov eos pad
    i = data.test.inputs.tolist().index([7, 5, 3, 2, 6, 8])
    assert data.test.targets[i].tolist() == [5, 3, 2, 6, 8, 0]
    res = run_fedavg(data, model, strategy, config)
    assert res.ledger.steps == 2
    held = load_tff("stackoverflow", tmp_path, num_users=2, vocab_size=5, sequence_length=6,
                    test_split="held_out")
    assert held.num_users == 2 and len(held.test) == 6  # held-out clients = the users' ids


def test_federated_models_and_unknown_names():
    m = build_federated_model("emnist-cnn", (1, 28, 28), 62)
    assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 62)
    assert sum(p.numel() for p in m.parameters()) == 1_206_590  # Reddi et al.'s EMNIST CNN
    assert not list(m.buffers())
    lm = build_federated_model("word-lstm", (20,), 10_004)
    assert lm(torch.zeros(1, 20, dtype=torch.long)).shape == (1, 10_004, 20)
    assert build_federated_model("mlp", (4,), 3, hidden=(5,))(torch.zeros(1, 4)).shape == (1, 3)
    with pytest.raises(ValueError, match="did you mean 'char-lstm'"):
        build_federated_model("char-lstn", (80,), 90)
    with pytest.raises(ValueError, match="char-lstm"):
        build_federated_model("char-lstm", (80,), 90, hiden=3)


def test_layout_errors_name_the_file_and_features(tmp_path):
    p = tmp_path / "x.h5"
    with h5py.File(p, "w") as f:
        f.create_group("clients")
    with pytest.raises(ValueError, match="no 'examples' group"):
        read_clients(p, ["pixels"])
    write_h5(p, {"c1": {"label": np.zeros(2, dtype=np.int32)}})
    with pytest.raises(ValueError, match=r"lacks feature\(s\) \['pixels'\]"):
        read_clients(p, ["pixels", "label"])
