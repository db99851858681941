"""Training data as users hand it to :func:`dpclip.make_private`, checked before the first step.

* numpy arrays (and lists of numbers) become tensors, said once on stderr: floating inputs take
  the model's floating dtype (float64 features for a float32 model would fail at the first
  matmul), integer targets become ``int64``;
* labels for the default loss (cross-entropy) must be integer class indices in
  ``0..C-1``, ``C`` the model's number of outputs: float labels, negative or too-large labels and
  string labels fail here, naming ``targets`` and the fix, instead of with torch's errors at the
  first step.

Privacy: the checks read the labels of the private data only to refuse them before training;
messages name counts and the valid range, never an example's value. The model's number of outputs
comes from one forward pass of an all-zero input of one example's shape (no private value enters
the model), without gradients and in eval mode, and nothing of it is kept.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn
from dpclip.engine.batch import map_batch

__all__ = ["check_class_targets", "convert_arrays"]


def _is_array(v: Any) -> bool:
    return type(v).__module__ == "numpy" and hasattr(v, "dtype") and hasattr(v, "shape")


def _string_labels(v: Any) -> bool:
    if _is_array(v):
        return v.dtype.kind in "USO"
    return isinstance(v, (list, tuple)) and bool(v) and isinstance(v[0], (str, bytes))


STRING_LABELS = (
    "make_private: targets are strings ({what}); the default loss (cross-entropy) needs integer "
    "class indices 0..C-1: map them first, e.g. classes, y = numpy.unique(labels, "
    "return_inverse=True) (keep `classes` to name the predictions), or pass loss_fn= that "
    "takes your targets")


def convert_arrays(data: Any, model: nn.Module, verbose: bool = True) -> Any:
    """``data`` with numpy arrays (in a pair ``(inputs, targets)``) turned into tensors; anything
    else unchanged. String labels raise a ``ValueError`` naming ``targets`` and the fix."""
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        return data
    x, y = data
    if _string_labels(y):
        what = f"numpy dtype {y.dtype}" if _is_array(y) else f"a {type(y).__name__} of str"
        raise ValueError(STRING_LABELS.format(what=what))
    if not (_is_array(x) or _is_array(y)):
        return data
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    said = []

    def convert(v: Any, what: str) -> Any:
        if not _is_array(v):
            return v
        if v.dtype.kind not in "biuf":
            raise ValueError(f"make_private: {what} is a numpy array of dtype {v.dtype}; give "
                             "numbers (a numeric numpy array or a tensor)")
        t = torch.from_numpy(v.copy() if not v.flags.writeable else v)
        t = t.to(dtype) if t.is_floating_point() else t.long() if v.dtype.kind in "biu" else t
        said.append(f"{what} {v.dtype} -> {str(t.dtype).removeprefix('torch.')}")
        return t

    out = (convert(x, "inputs"), convert(y, "targets"))
    if verbose and said:
        print(f"dpclip: converted numpy arrays to tensors ({'; '.join(said)})", file=sys.stderr)
    return out


def _num_outputs(model: nn.Module, x: Any, device: torch.device | None) -> int | None:
    """The model's number of outputs per example (the last dimension of ``model(one example)``),
    or None when one forward pass cannot tell (the first step then reports any problem)."""
    # zeros of one example's shape and dtype: the number of outputs without touching private data
    one = map_batch(lambda t: torch.zeros_like(t[:1], device=device), x)
    was = model.training
    try:
        model.eval()
        with torch.no_grad():
            if isinstance(one, Tensor):
                out = model(one)
            elif isinstance(one, dict):
                out = model(**one)
            else:
                out = model(*one)
    except Exception:  # noqa: BLE001 - the first step reports it, with the engine's context
        return None
    finally:
        model.train(was)
    out = getattr(out, "logits", out)
    if not isinstance(out, Tensor) or out.ndim != 2:
        return None
    return int(out.shape[-1])


def check_class_targets(model: nn.Module, x: Any, y: Any,
                        device: torch.device | None = None) -> None:
    """Refuse targets the default cross-entropy loss cannot take, before the first step: float
    dtypes, negative labels, labels >= the model's number of outputs."""
    if not isinstance(y, Tensor) or y.ndim != 1:
        return  # tuples/dicts of targets or per-token labels: the user's loss_fn decides
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        whole = bool(y.dtype == torch.bool or torch.all(y == torch.round(y)))
        fix = ("convert them with targets.long()" if whole else
               "for regression pass loss_fn= returning one loss per example (e.g. lambda out, y: "
               "(out.squeeze(-1) - y) ** 2)")
        raise ValueError(f"make_private: targets have dtype {str(y.dtype).removeprefix('torch.')}"
                         f"; the default loss (cross-entropy) needs integer class indices 0..C-1;"
                         f" {fix}")
    if y.numel() == 0:
        return
    c = _num_outputs(model, x, device)
    neg = int((y < 0).sum())
    over = int((y >= c).sum()) if c is not None else 0
    if neg or over:
        rng = f"0..{c - 1} (the model has {c} outputs)" if c is not None else "0..C-1"
        raise ValueError(  # (how many: a count of private labels, not quoted)
            f"make_private: some of the targets are outside {rng}; "
            "map the labels to 0..C-1 (e.g. numpy.unique(labels, return_inverse=True)) or give "
            "the model one output per class")
