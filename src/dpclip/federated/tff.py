"""The federated datasets of TensorFlow Federated, read from their published HDF5 files.

Users are the files' clients (writers, speaking roles, Stack Overflow users): the natural
privacy unit of these benchmarks. Nothing is downloaded; the files are found in a user directory
(``data_dir``, ``$DPCLIP_DATA``, ``/usr/share/datasets``, each also with the dataset's
sub-directory) and a missing file raises ``DatasetNotFoundError`` naming the file and the archive
to fetch. Reading needs ``h5py`` (``pip install dpclip[federated]``).

Layout (TFF's ``HDF5ClientData``): ``examples/<client_id>/<feature>``, one array per feature with
one entry per example.

============================ ============================================== ==================
name                         files (archive under                           features used
                             ``storage.googleapis.com/tff-datasets-public``)
============================ ============================================== ==================
``emnist-fed``               ``fed_emnist_{train,test}.h5``                 ``pixels`` (28x28
                             (``fed_emnist.tar.bz2``), 62 classes           float, background
``emnist-digits-fed``        ``fed_emnist_digitsonly_{train,test}.h5``      1.0), ``label``
                             (``fed_emnist_digitsonly.tar.bz2``), 10
``shakespeare``              ``shakespeare_{train,test}.h5``                ``snippets``
                             (``shakespeare.tar.bz2``)                      (strings)
``stackoverflow``            ``stackoverflow_{train,held_out,test}.h5``     ``tokens`` (space-
                             (``stackoverflow.tar.bz2``) and                separated words)
                             ``stackoverflow.word_count``
                             (``stackoverflow.word_count.tar.bz2``)
============================ ============================================== ==================

Tasks, tokenised as TFF's baselines do (``tff.simulation.baselines``):

* EMNIST: character recognition, inputs ``(1, 28, 28)`` as stored.
* Shakespeare: next-character prediction. Characters map to ``1 + index`` in TFF's
  :data:`CHAR_VOCAB` (86 characters), out-of-vocabulary to ``87``, ``bos = 88``, ``eos = 89``,
  padding ``0``; each snippet becomes ``[bos] + chars + [eos]``, zero-padded to a multiple of
  ``sequence_length + 1`` (default 80 + 1) and cut into rows; input = row[:-1], target = row[1:].
* Stack Overflow: next-word prediction. The vocabulary is the first ``vocab_size`` (default
  10,000) words of ``stackoverflow.word_count`` (most frequent first); word ``w`` maps to
  ``1 + index``, out-of-vocabulary to ``V + 1``, ``bos = V + 2``, ``eos = V + 3``, padding ``0``;
  a sentence becomes ``[bos] + words[:L] (+ [eos] if shorter than L)``, zero-padded to ``L + 1``
  (``L = sequence_length``, default 20); input = [:-1], target = [1:].

For the two text tasks the loss and the accuracy skip padding (``FederatedData.ignore_index =
0``); out-of-vocabulary, bos and eos targets count (TFF also reports accuracies without them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from dpclip.data.base import DatasetNotFoundError, TensorSplit
from dpclip.federated.data import FederatedData


@dataclass(frozen=True, eq=False)
class TokenSplit:
    """A user's (or the test set's) token sequences: ``inputs`` and ``targets`` both int64
    ``(n, L)`` (the targets are the inputs shifted by one). The sequence counterpart of
    ``dpclip.data.TensorSplit`` (whose targets are one class per example)."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.inputs.dtype != torch.int64 or self.targets.dtype != torch.int64:
            raise ValueError("TokenSplit inputs and targets must be int64 token ids")
        if self.inputs.dim() != 2 or self.inputs.shape != self.targets.shape:
            raise ValueError(f"TokenSplit inputs and targets must both be (n, L), got "
                             f"{tuple(self.inputs.shape)} and {tuple(self.targets.shape)}")

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def subset(self, indices: torch.Tensor) -> "TokenSplit":
        return TokenSplit(self.inputs[indices], self.targets[indices])


def _rows_split(rows: torch.Tensor) -> TokenSplit:
    return TokenSplit(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())

__all__ = [
    "CHAR_VOCAB",
    "TFF_DATASETS",
    "TokenSplit",
    "find_tff_files",
    "load_tff",
    "read_clients",
    "shakespeare_tokens",
    "stackoverflow_tokens",
    "stackoverflow_vocab",
]

_URL = "https://storage.googleapis.com/tff-datasets-public"

#: TFF's Shakespeare character vocabulary (``char_prediction_preprocessing.CHAR_VOCAB``)
CHAR_VOCAB = list(
    "dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#'/37;?bfjnrvzBFJNRVZ\"&*.26:\naeimquyAEIMQUY]!%)-159\r")

#: name -> (sub-directory, {split: file}, archive, features per client)
TFF_DATASETS: dict[str, tuple[str, dict[str, str], str, str]] = {
    "emnist-fed": ("emnist", {"train": "fed_emnist_train.h5", "test": "fed_emnist_test.h5"},
                   f"{_URL}/fed_emnist.tar.bz2", "pixels (n, 28, 28), label (n,)"),
    "emnist-digits-fed": ("emnist", {"train": "fed_emnist_digitsonly_train.h5",
                                     "test": "fed_emnist_digitsonly_test.h5"},
                          f"{_URL}/fed_emnist_digitsonly.tar.bz2",
                          "pixels (n, 28, 28), label (n,)"),
    "shakespeare": ("shakespeare", {"train": "shakespeare_train.h5",
                                    "test": "shakespeare_test.h5"},
                    f"{_URL}/shakespeare.tar.bz2", "snippets (n,) strings"),
    "stackoverflow": ("stackoverflow", {"train": "stackoverflow_train.h5",
                                        "held_out": "stackoverflow_held_out.h5",
                                        "test": "stackoverflow_test.h5"},
                      f"{_URL}/stackoverflow.tar.bz2", "tokens (n,) strings"),
}
WORD_COUNT_FILE = "stackoverflow.word_count"
WORD_COUNT_URL = f"{_URL}/stackoverflow.word_count.tar.bz2"


def _dirs(name: str, data_dir: str | os.PathLike[str] | None) -> list[Path]:
    sub = TFF_DATASETS[name][0]
    dirs: list[Path] = []
    if data_dir is not None:
        dirs += [Path(data_dir), Path(data_dir) / sub]
    env = os.environ.get("DPCLIP_DATA")
    if env:
        dirs += [Path(env) / sub, Path(env)]
    dirs.append(Path("/usr/share/datasets") / sub)
    return dirs


def find_tff_files(name: str, data_dir: str | os.PathLike[str] | None = None,
                   splits: Sequence[str] = ("train", "test")) -> dict[str, Path]:
    """``{split: path}`` of TFF dataset ``name``'s files for ``splits`` (all in one directory)."""
    if name not in TFF_DATASETS:
        raise ValueError(f"unknown federated dataset {name!r}; valid: {', '.join(TFF_DATASETS)}")
    sub, files, url, _ = TFF_DATASETS[name]
    bad = [s for s in splits if s not in files]
    if bad:
        raise ValueError(f"{name} has no split(s) {bad}; splits: {', '.join(files)}")
    want = [files[s] for s in splits]
    dirs = _dirs(name, data_dir)
    for d in dirs:
        if all((d / f).is_file() for f in want):
            return {s: d / files[s] for s in splits}
    raise DatasetNotFoundError(
        f"federated dataset {name!r}: files {', '.join(want)} not found in any of "
        f"{', '.join(str(d) for d in dirs)}. dpclip never downloads data: fetch {url}, unpack it "
        f"into <dir>/{sub}/ and pass --data-dir <dir> (or set DPCLIP_DATA=<dir>)")


def _h5py() -> Any:
    try:
        import h5py  # type: ignore[import-not-found]
    except ImportError:
        raise ImportError("reading the TFF federated files needs h5py, which is not installed: "
                          "pip install 'dpclip[federated]' (or pip install h5py)") from None
    return h5py


def read_clients(path: str | os.PathLike[str], features: Sequence[str],
                 clients: Sequence[str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """``{client_id: {feature: array}}`` from a TFF HDF5 file (``examples/<client>/<feature>``);
    ``clients`` restricts (and orders) the clients read. A missing group or feature is an error
    naming the file, the client and the features present."""
    h5py = _h5py()
    out: dict[str, dict[str, np.ndarray]] = {}
    with h5py.File(path, "r") as f:
        if "examples" not in f:
            raise ValueError(f"{path}: no 'examples' group (TFF layout examples/<client>/<feature>)"
                             f"; top-level keys: {sorted(f.keys())}")
        ex = f["examples"]
        for cid in (sorted(ex.keys()) if clients is None else clients):
            grp = ex[cid]
            missing = [k for k in features if k not in grp]
            if missing:
                raise ValueError(f"{path}: client {cid!r} lacks feature(s) {missing}; it has "
                                 f"{sorted(grp.keys())}")
            out[cid] = {k: grp[k][()] for k in features}
    return out


def client_ids(path: str | os.PathLike[str]) -> list[str]:
    """Sorted client ids of a TFF HDF5 file."""
    with _h5py().File(path, "r") as f:
        return sorted(f["examples"].keys())


def _text(x: Any) -> str:
    return x.decode("utf-8") if isinstance(x, (bytes, np.bytes_)) else str(x)


def shakespeare_tokens(snippets: Sequence[Any], sequence_length: int = 80) -> torch.Tensor:
    """Rows of ``sequence_length + 1`` token ids of a client's snippets (TFF's
    ``char_prediction_preprocessing``; see the module docstring)."""
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be >= 1, got {sequence_length!r}")
    table = {c: i + 1 for i, c in enumerate(CHAR_VOCAB)}
    oov, bos, eos = len(CHAR_VOCAB) + 1, len(CHAR_VOCAB) + 2, len(CHAR_VOCAB) + 3
    split = sequence_length + 1
    rows: list[list[int]] = []
    for s in snippets:
        raw = s if isinstance(s, (bytes, np.bytes_)) else str(s).encode("utf-8")
        # TFF splits the bytes (tf.strings.bytes_split): one token per byte
        ids = [bos] + [table.get(chr(b), oov) for b in bytes(raw)] + [eos]
        ids += [0] * ((-len(ids)) % split)
        rows += [ids[i:i + split] for i in range(0, len(ids), split)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, split)


def stackoverflow_vocab(data_dir: str | os.PathLike[str] | None, vocab_size: int = 10_000,
                        directory: Path | None = None) -> list[str]:
    """The first ``vocab_size`` words of ``stackoverflow.word_count`` (TFF's vocabulary)."""
    dirs = ([directory] if directory is not None else []) + _dirs("stackoverflow", data_dir)
    for d in dirs:
        p = d / WORD_COUNT_FILE
        if p.is_file():
            words: list[str] = []
            with open(p, encoding="utf-8") as fh:
                for line in fh:
                    parts = line.split()
                    if len(parts) != 2:
                        raise ValueError(f"{p}: expected 'word count' lines, got {line!r}")
                    words.append(parts[0])
                    if len(words) == vocab_size:
                        break
            return words
    raise DatasetNotFoundError(
        f"stackoverflow: the word counts {WORD_COUNT_FILE} (the vocabulary of TFF's next-word "
        f"task) are not in any of {', '.join(str(d) for d in dirs)}. Fetch {WORD_COUNT_URL} and "
        f"unpack it beside the .h5 files")


def stackoverflow_tokens(sentences: Sequence[Any], vocab: Sequence[str],
                         sequence_length: int = 20) -> torch.Tensor:
    """``(n, sequence_length + 1)`` token ids (TFF's ``word_prediction_preprocessing``)."""
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be >= 1, got {sequence_length!r}")
    table = {w: i + 1 for i, w in enumerate(vocab)}
    v = len(vocab)
    oov, bos, eos = v + 1, v + 2, v + 3
    out = torch.zeros(len(sentences), sequence_length + 1, dtype=torch.int64)
    for i, s in enumerate(sentences):
        words = _text(s).split(" ")[:sequence_length]
        ids = [table.get(w, oov) for w in words]
        if len(ids) < sequence_length:
            ids.append(eos)
        ids = [bos] + ids
        out[i, :len(ids)] = torch.tensor(ids)
    return out


def _pick(ids: list[str], k: int | None, rng: np.random.Generator) -> list[str]:
    if k is None or k >= len(ids):
        return ids
    return sorted(rng.choice(ids, size=k, replace=False).tolist())


def _cap(split: Any, k: int | None, rng: np.random.Generator) -> TensorSplit:
    if k is None or len(split) <= k:
        return split
    return split.subset(torch.as_tensor(np.sort(rng.choice(len(split), k, replace=False))))


def _concat(parts: list[Any]) -> Any:
    if not parts:
        raise ValueError("the chosen test clients hold no examples; choose more users")
    return type(parts[0])(torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts]))


def load_tff(name: str, data_dir: str | os.PathLike[str] | None = None, *,
             num_users: int | None = None, max_user_examples: int | None = None,
             max_test_examples: int | None = None, seed: int = 0,
             sequence_length: int | None = None, vocab_size: int = 10_000,
             test_split: str = "test") -> FederatedData:
    """TFF dataset ``name`` as :class:`FederatedData` (users = the train file's clients).

    ``num_users``: a seeded random subset of the clients (all when ``None``); their examples in
    ``test_split`` form the test set where the clients appear there (EMNIST, Shakespeare), else
    (Stack Overflow, whose test users differ) the same number of seeded random test clients.
    ``max_user_examples`` caps each user (seeded subsample; TFF's ``max_elements``),
    ``max_test_examples`` the test set. All choices follow the public ``seed``."""
    if name not in TFF_DATASETS:
        raise ValueError(f"unknown federated dataset {name!r}; valid: {', '.join(TFF_DATASETS)}")
    for arg, val in (("num_users", num_users), ("max_user_examples", max_user_examples),
                     ("max_test_examples", max_test_examples)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{arg} must be an int >= 1 or None, got {val!r}")
    paths = find_tff_files(name, data_dir, ("train", test_split))
    rng = np.random.default_rng(int(seed))
    users_ids = _pick(client_ids(paths["train"]), num_users, rng)
    test_all = client_ids(paths[test_split])
    present = set(test_all)
    test_ids = [c for c in users_ids if c in present] if num_users is not None else test_all
    if not test_ids:
        test_ids = _pick(test_all, num_users, rng)
    info: dict[str, Any] = {"partition": "natural (TFF clients)", "partition_seed": int(seed),
                            "tff_files": [paths["train"].name, paths[test_split].name]}
    ignore_index = None
    if name.startswith("emnist"):
        feats = ("pixels", "label")

        def convert(fields: dict[str, np.ndarray]) -> TensorSplit:
            x = torch.as_tensor(np.asarray(fields["pixels"], dtype=np.float32)).unsqueeze(1)
            return TensorSplit(x, torch.as_tensor(np.asarray(fields["label"], dtype=np.int64)))

        num_classes = 10 if name == "emnist-digits-fed" else 62
        input_shape: tuple[int, ...] = (1, 28, 28)
    elif name == "shakespeare":
        feats = ("snippets",)
        length = 80 if sequence_length is None else int(sequence_length)

        def convert(fields: dict[str, np.ndarray]) -> Any:
            return _rows_split(shakespeare_tokens(list(fields["snippets"]), length))

        num_classes, input_shape, ignore_index = len(CHAR_VOCAB) + 4, (length,), 0
        info["sequence_length"] = length
    else:
        feats = ("tokens",)
        length = 20 if sequence_length is None else int(sequence_length)
        vocab = stackoverflow_vocab(data_dir, vocab_size, paths["train"].parent)

        def convert(fields: dict[str, np.ndarray]) -> Any:
            return _rows_split(stackoverflow_tokens(list(fields["tokens"]), vocab, length))

        num_classes, input_shape, ignore_index = len(vocab) + 4, (length,), 0
        info.update(sequence_length=length, vocab_size=len(vocab))
    users = []
    for cid, fields in read_clients(paths["train"], feats, users_ids).items():
        split = _cap(convert(fields), max_user_examples, rng)
        if len(split):
            users.append(split)
    tests = [convert(f) for f in read_clients(paths[test_split], feats, test_ids).values()]
    test = _cap(_concat([t for t in tests if len(t)]), max_test_examples, rng)
    if max_user_examples is not None:
        info["max_user_examples"] = max_user_examples
    return FederatedData(name, tuple(users), test, num_classes, input_shape, info, ignore_index)
