"""Batches whose inputs (and targets) are tensors, tuples or dicts of tensors.

The engines accept ``inputs`` and ``targets`` as a single tensor or as a (nested) tuple, list or
dict of tensors. Every tensor leaf holds the batch in dimension 0 (the same size ``B`` for every
leaf of both), and the model is called as

* ``model(x)`` for a tensor ``x``;
* ``model(*inputs)`` for a tuple or list (``model(x1, x2)``);
* ``model(**inputs)`` for a dict (``model(input_ids=..., attention_mask=...)``, the Hugging Face
  convention).

``loss_fn(outputs, targets)`` receives the targets with the same structure as given. Example ``i``
is the slice ``[i]`` of every leaf.

``None`` leaves are passed through (they carry no data). Any other non-tensor leaf (a number, a
string, a flag) and any tensor without the batch in dimension 0 (a 0-d tensor, a shared ``(1, T)``
position tensor) is refused with :class:`ValueError` naming its place: a value that is the same for
every example is public configuration and belongs in the model or the loss (a module attribute, a
closure or ``functools.partial``), where it is visibly not per-example data; a value that differs
per example must be a tensor with one row per example, so that the sampler, the engines and the
separability check treat it as the example's data.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

__all__ = ["batch_leaves", "call_model", "check_batch", "map_batch", "own_copy", "owned_slice",
           "slice_batch"]


def _path(kp: Any) -> str:
    return pytree.keystr(kp) if kp else ""


def _who(engine: str) -> str:
    if not engine:
        return ""
    return f"{engine}: " if engine in ("make_private", "dp_step") else f"{engine} engine: "


def batch_leaves(tree: Any, what: str = "inputs", engine: str = "") -> list[Tensor]:
    """The tensor leaves of ``tree`` (``None`` skipped); ``ValueError`` on any other leaf."""
    if isinstance(tree, Tensor):
        return [tree]
    leaves, _ = pytree.tree_flatten_with_path(tree)
    out = []
    for kp, leaf in leaves:
        if isinstance(leaf, Tensor):
            out.append(leaf)
        elif leaf is not None:
            raise ValueError(  # the value itself is not quoted: it may be private data
                f"{_who(engine)}{what}{_path(kp)} is a {type(leaf).__name__}, not a tensor "
                "with the batch in dimension 0. Inputs and targets are tensors, or tuples/dicts "
                "of tensors, one row per example. A value shared by every example is public "
                "configuration: set it in the model or the loss (an attribute, a closure or "
                "functools.partial); a per-example value must be a tensor with one row per "
                "example")
    return out


def check_batch(inputs: Any, targets: Any, engine: str) -> int:
    """The batch size ``B``: dimension 0 of every tensor leaf of ``inputs`` and ``targets``.

    ``ValueError`` (naming the leaf) on a non-tensor leaf, a 0-d tensor, disagreeing sizes, or
    inputs without any tensor."""
    sizes: list[tuple[str, tuple[int, ...]]] = []
    for what, tree in (("inputs", inputs), ("targets", targets)):
        if isinstance(tree, Tensor):
            sizes.append((what, tuple(tree.shape)))
            continue
        got = False
        for kp, leaf in pytree.tree_flatten_with_path(tree)[0]:
            batch_leaves(leaf, f"{what}{_path(kp)}", engine)  # raises on a non-tensor leaf
            if isinstance(leaf, Tensor):
                sizes.append((f"{what}{_path(kp)}", tuple(leaf.shape)))
                got = True
        if not got:
            raise ValueError(f"{_who(engine)}{what} hold no tensor; give a tensor, or a "
                             "tuple/dict of tensors with the batch in dimension 0")
    # ranks and names, not shapes: dimension 0 is the realised batch size, which is private
    for name, shape in sizes:
        if not shape:
            raise ValueError(
                f"{_who(engine)}{name} is a 0-d tensor; inputs and targets need a leading "
                f"batch dimension (ranks: {', '.join(f'{n} {len(s)}-d' for n, s in sizes)})")
    b = sizes[0][1][0]
    for name, shape in sizes:
        if shape[0] != b:
            odd = [n for n, s in sizes if s[0] != b]
            raise ValueError(
                f"{_who(engine)}inputs and targets have different batch sizes (dimension 0 "
                f"of every tensor): {', '.join(odd)} differ(s) from {sizes[0][0]} (sizes not "
                "quoted: they hold the realised batch size, which is private). Every tensor of "
                "the inputs and targets needs the batch first; a tensor shared by every example "
                "(e.g. (1, T) positions) belongs in the model (a buffer, broadcast there)")
    return int(b)


def map_batch(fn: Callable[[Tensor], Tensor], tree: Any) -> Any:
    """``fn`` applied to every tensor leaf of ``tree`` (the structure kept)."""
    if isinstance(tree, Tensor):
        return fn(tree)
    return pytree.tree_map(lambda t: fn(t) if isinstance(t, Tensor) else t, tree)


#: the engines run every chunk on a multiple of this many rows (:func:`padded_rows`)
ROW_BLOCK = 32


def padded_rows(n: int) -> int:
    """The rows a chunk of ``n`` examples runs on: ``n`` rounded up to a multiple of
    :data:`ROW_BLOCK`. torch's CPU kernels pick their code by the number of rows: MKL's product
    with one output column rounds its last rows otherwise, its products of 3 and of 4 rows round
    every row otherwise, a reduction over positions with the batch innermost in memory sums the
    last columns on another path, a convolution of one example runs off oneDNN (eightieth and
    seventy-ninth hostile reviews). With ``n`` examples and padding copies after them, every row
    count is a multiple of 32 and the real examples never lie in a kernel's leftover rows: which
    vector is computed for an example no longer depends on how many others share its batch
    (``benchmarks/results/row_block_cpu.md``; docs/engines.md, "Rounding that depends on the
    batch size")."""
    return -(-n // ROW_BLOCK) * ROW_BLOCK


def note_padded(exc: BaseException, engine: str) -> None:
    """Add to an error the model raised on a padded chunk what the engine changed (its type and
    text stay the model's own; no number: the batch size is private)."""
    exc.add_note(
        f"dpclip {engine} engine: this batch ran with copies of its first example after it, up "
        "to a multiple of 32 rows (dpclip.engine.batch.padded_rows: the number of rows must not "
        "set the CPU kernels' rounding). A model whose shapes depend on the number of examples "
        "(a layer sized by the batch, the examples read as channels) uses the private batch size "
        "and cannot run here")


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """A leaf of ``n`` examples as a batch of ``rows``: the examples, then copies of the first
    (valid input for any model; the engines give them weight 0 and drop their losses)."""
    n = t.shape[0]
    if rows == n:
        return t
    return torch.cat([t, t[:1].expand(rows - n, *t.shape[1:])])


def slice_batch(tree: Any, start: int, stop: int) -> Any:
    """Examples ``start:stop`` of every leaf."""
    if isinstance(tree, Tensor):
        return tree[start:stop]
    return map_batch(lambda t: t[start:stop], tree)


def own_copy(t: Tensor) -> Tensor:
    """``t``'s values in storage of their own (contiguous where strided; autograd kept)."""
    if t.layout is torch.strided:
        return t.clone(memory_format=torch.contiguous_format)
    return t.clone()


def owned_slice(tree: Any, start: int, stop: int) -> Any:
    """Examples ``start:stop`` of every leaf, as copies the engine owns: the model and loss never
    see the caller's tensors (or views of their storage), whose lifetime is the caller's. A
    finalizer or ``__del__`` the forward or loss attaches to what it is handed then runs when the
    engine drops its copy, inside the chunk's checks, not when the caller's loop drops the batch
    after every check (hundred-and-thirtieth hostile review: the weights 6,000-18,000 apart on
    neighbouring datasets through ``make_private``; the same through ``engine.compute``)."""
    return map_batch(own_copy, slice_batch(tree, start, stop))


def call_model(model: nn.Module | Callable[..., Any], inputs: Any) -> Any:
    """``model(x)``, ``model(*inputs)`` (tuple or list) or ``model(**inputs)`` (dict)."""
    if isinstance(inputs, Tensor):
        return model(inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def first_tensor(tree: Any) -> Tensor:
    """A tensor leaf of ``tree`` (for dtype and device), or an empty float tensor."""
    if isinstance(tree, Tensor):
        return tree
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, Tensor):
            return leaf
    return torch.empty(0)
