"""Deterministic, stratified splits of a :class:`TensorSplit`.

Used for the train/test split of datasets that ship without one (digits, breast-cancer,
mnist-5k) and for carving a public subset out of a training set (Lin et al.'s public proxy, the
greedy threshold search of ``dpclip.search``).

Privacy note: which examples land in the public part depends only on the labels and the seed; the
public part must be treated as public (its examples get no privacy protection) and only the
private part may be fed to the private training run.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dpclip.data.base import TensorSplit

__all__ = ["independent_public_split", "public_private_split", "stratified_split_indices"]


def _check_fraction(fraction: float, argument: str) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"{argument} must be a float in (0, 1), got {fraction!r}")
    fraction = float(fraction)
    if not (0.0 < fraction < 1.0):
        raise ValueError(f"{argument} must lie strictly between 0 and 1, got {fraction}")
    return fraction


def stratified_split_indices(
    targets: Tensor, fraction: float, seed: int, *, argument: str = "fraction"
) -> tuple[Tensor, Tensor]:
    """Split example indices into a ``fraction`` part and the rest, stratified by class.

    The selected part has exactly ``round(fraction * N)`` examples (half rounds up); the per-class
    counts are apportioned by largest remainder, so each class is represented in proportion.
    Within a class the examples are chosen by a ``torch.Generator`` seeded with ``seed``: the same
    ``(targets, fraction, seed)`` always gives the same split.

    Returns:
        ``(selected, rest)``: two disjoint, sorted int64 index tensors covering ``range(N)``.

    Raises:
        ValueError: if ``fraction`` is not in (0, 1) or either part would be empty.
    """
    fraction = _check_fraction(fraction, argument)
    targets = torch.as_tensor(targets)
    if targets.dim() != 1:
        raise ValueError(f"targets must be 1-D, got shape {tuple(targets.shape)}")
    n = int(targets.shape[0])
    n_selected = int(math.floor(fraction * n + 0.5))
    if n < 2:
        raise ValueError(f"cannot split {n} example(s) into two non-empty parts")
    if n_selected == 0 or n_selected == n:
        raise ValueError(
            f"{argument}={fraction} of {n} examples leaves an empty part "
            f"({n_selected} vs {n - n_selected}); choose {argument} between {1 / n:.3g} and "
            f"{1 - 1 / n:.3g}"
        )
    classes, counts = torch.unique(targets, sorted=True, return_counts=True)
    quotas = [fraction * int(c) for c in counts]
    per_class = [int(math.floor(q)) for q in quotas]
    # largest remainder; ties go to the lower class index (stable sort)
    order = sorted(range(len(quotas)), key=lambda k: -(quotas[k] - per_class[k]))
    deficit = n_selected - sum(per_class)
    for k in order[:deficit] if deficit > 0 else []:
        per_class[k] += 1

    generator = torch.Generator().manual_seed(int(seed))
    selected = []
    for cls, take in zip(classes.tolist(), per_class, strict=True):
        members = torch.nonzero(targets == cls, as_tuple=True)[0]
        perm = torch.randperm(members.numel(), generator=generator)
        selected.append(members[perm[:take]])
    chosen = torch.sort(torch.cat(selected)).values
    mask = torch.ones(n, dtype=torch.bool)
    mask[chosen] = False
    rest = torch.nonzero(mask, as_tuple=True)[0]
    return chosen, rest


def public_private_split(
    split: TensorSplit, public_fraction: float, seed: int
) -> tuple[TensorSplit, TensorSplit]:
    """Split ``split`` into a public part and a private part, stratified by class.

    The public part has ``round(public_fraction * N)`` examples, the private part the rest; the
    two are disjoint and together cover every example once. The same ``seed`` always gives the
    same split; examples keep their original relative order.

    Privacy: only the private part is protected by the DP guarantee of a run trained on it; the
    public part is released (e.g. used to tune clipping thresholds) without any accounting.

    Raises:
        ValueError: if ``public_fraction`` is not strictly between 0 and 1, or a part would be
            empty.
    """
    if not isinstance(split, TensorSplit):
        raise TypeError(f"split must be a TensorSplit, got {type(split).__name__}")
    public_idx, private_idx = stratified_split_indices(
        split.targets, public_fraction, seed, argument="public_fraction"
    )
    return split.subset(public_idx), split.subset(private_idx)


def independent_public_split(
    split: TensorSplit, public_fraction: float, seed: int
) -> tuple[TensorSplit, TensorSplit]:
    """Split ``split`` into a public part and a private part, each example on its own: it is public
    when a keyed hash of its own bytes (input and label, with ``seed`` as the key) falls below
    ``public_fraction``. So no example's presence moves any OTHER example between the parts
    (the stratified split, :func:`public_private_split`, draws each class's members by a
    permutation of the class: one private example's presence moved 14 others between the parts at
    N = 200, and what the public part gave, ALC's public norms, unnoised, told neighbouring
    datasets apart; two-hundred-and-sixth hostile review). The public part has about
    ``public_fraction * N`` examples (binomial), not stratified; identical examples land together.
    The same ``seed`` always gives the same split; examples keep their relative order.

    Privacy: the public part gets no protection (it is released without accounting); the private
    part is protected, and which examples it holds depends on each example alone.

    Raises:
        ValueError: if ``public_fraction`` is not strictly between 0 and 1, or a part is empty.
    """
    import hashlib

    if not isinstance(split, TensorSplit):
        raise TypeError(f"split must be a TensorSplit, got {type(split).__name__}")
    fraction = _check_fraction(public_fraction, "public_fraction")
    key = int(seed).to_bytes(16, "little", signed=True)
    n = len(split)
    inputs = split.inputs.detach().cpu().contiguous().reshape(n, -1).numpy()
    targets = split.targets.detach().cpu().tolist()
    cut = int(fraction * 2**64)
    public = [int.from_bytes(hashlib.blake2b(inputs[i].tobytes() + int(targets[i]).to_bytes(
        8, "little", signed=True), key=key, digest_size=8).digest(), "little") < cut
        for i in range(n)]
    mask = torch.tensor(public, dtype=torch.bool)
    n_public = int(mask.sum())
    if n_public == 0 or n_public == n:
        raise ValueError(
            f"public_fraction={fraction} of {n} examples left an empty part ({n_public} public, "
            f"{n - n_public} private); choose a larger (or smaller) public_fraction or another seed")
    pub = torch.nonzero(mask, as_tuple=True)[0]
    priv = torch.nonzero(~mask, as_tuple=True)[0]
    return split.subset(pub), split.subset(priv)
