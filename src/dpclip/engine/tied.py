"""Exact per-example norms of tied parameters without forming per-example gradients: the cross terms
between the uses of one weight by ghost inner products (issue 31, item 5).

A parameter used by several calls (GPT-2's ``wte`` read by the token Embedding and by ``lm_head``,
a Linear called twice) has per-example gradient ``G_i = sum_u G_{u,i}``, one term per use. Its
squared norm is

    ``||G_i||^2 = sum_u ||G_{u,i}||^2 + 2 sum_{u < v} <G_{u,i}, G_{v,i}>``.

Every use handled here writes its gradient as a sum over positions of outer products in the
parameter's own layout, ``G_u = sum_t L_t R_t^T``:

* Linear (weight ``(p, d)``): ``L_t = b_t`` (output gradient), ``R_t = a_t`` (input);
* ``transformers`` Conv1D (weight ``(d, p)``): ``L_t = a_t``, ``R_t = b_t``;
* Embedding (weight ``(V, p)``): ``L_t`` the one-hot vector of token ``x_t``, ``R_t = b_t``.

Then ``<G_u, G_v> = sum_{t, s} (L_t . L'_s)(R_t . R'_s)`` (the ghost trick with two different
activation / gradient pairs, Li et al. 2022): two ``T_u x T_v`` cross matrices per example, where a
one-hot factor makes ``L_t . L'_s`` an index equality (two Embeddings) or a gather of the dense
factor at the token ids (an Embedding and ``lm_head``: ``b'_s[x_t]``). Nothing of the parameter's
size is formed (GPT-2 small's ``wte`` has 38.6M entries).

Rounding (:func:`tied_norm_bound`): the result is an upper bound of the norm of the vector the
engine actually sums for example ``i`` (divided by its weight), ``||sum_u Vt_{u,i}||``, where each
use's summed part is formed by its own rule: ``Vt_u = G_u + E_u`` with ``||E_u|| <= eps_u A_u``
(``A_u = sum_t ||L_t|| ||R_t||``, ``eps_u`` the use's book-keeping error and the batch
reduction's, both relative to ``A_u``, so that cancellation BETWEEN the uses cannot hide them).
The squared norm of each use is bounded from the engine's own bound of that use,
``||G_u|| <= n_u (1 + rel_u) + eps_u A_u``; each cross term carries its error bound
``gram_uv A_u A_v`` (``gram_uv`` as the Linear rule's ghost bound: the cross matrices' products
rounded, the inner product summed in float64). So

    ``||sum_u Vt_u|| <= sqrt(max(0, sum_u up_u + 2 sum_{u<v} (c_uv + gram_uv A_u A_v) + slack))
    + sum_u eps_u A_u``,

and the engine takes the minimum of this and the triangle bound ``sum_u n_u``. Where the uses
cancel (the square root's error term dominates) the triangle bound may be the smaller; both are
valid, so the minimum is. Cost: ``T_u T_v (r + c)`` flops per example and pair (``r``/``c`` the
widths of the dense factors), as a ghost norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["TiedUse", "tied_norm_bound"]

#: cross matrices are formed for at most this many floats at a time (slices of examples)
_TEMP_MAX_NUMEL = 1 << 22

_vecdot = torch.linalg.vecdot


def _gam64(n: int) -> float:
    nu = n * 2.0 ** -53
    return nu / (1 - nu) if nu < 0.5 else math.inf


@dataclass
class TiedUse:
    """One use of a tied parameter, as ``G = sum_t L_t R_t^T`` per example.

    Attributes:
        onehot: ``left`` holds token ids ``(B, T)`` (an Embedding), else dense ``(B, T, rows)``.
        left: the left factors (or ids); ``right``: the right factors ``(B, T, cols)``.
        bound: ``(B,)`` the engine's bound of this use's summed vector divided by the weight
            (the square root of its rule's squared bound).
        rel: the relative factor ``bound`` may still need (kept vectors, 2-D Linear: applied by
            the engine at the end for single uses; here explicitly).
        eps: the error of the use's summed vector relative to ``A_u`` (book-keeping and batch
            reduction).
    """

    onehot: bool
    left: Tensor
    right: Tensor
    bound: Tensor
    rel: float
    eps: float


def _abs_sum(u: TiedUse, rnd: Any) -> Tensor:
    """``A_u = sum_t ||L_t|| ||R_t||`` per example, an upper bound in float64: the norms in the
    working precision (no float64 copy of a ``(B, T, vocab)`` factor), their rounding bounded
    by ``gam(widths + T + 4)`` (two norms, their products summed over T)."""
    nr = torch.linalg.vector_norm(u.right, dim=2).double()
    if u.onehot:
        s = nr.sum(1)
        n = u.right.shape[2] + u.right.shape[1] + 4
    else:
        s = _vecdot(torch.linalg.vector_norm(u.left, dim=2).double(), nr)
        n = u.left.shape[2] + u.right.shape[2] + u.right.shape[1] + 4
    return s * (1 + rnd.gam(n)) * (1 + _gam64(n))


def _cross(u: TiedUse, v: TiedUse, sl: slice) -> Tensor:
    """``sum_{t,s} (L_t . L'_s)(R_t . R'_s)`` for the examples ``sl``, float64."""
    ru, rv = u.right[sl], v.right[sl]
    q = torch.bmm(ru, rv.transpose(1, 2))  # (n, Tu, Tv)
    tu, tv = q.shape[1], q.shape[2]
    if u.onehot and v.onehot:
        p = (u.left[sl].unsqueeze(2) == v.left[sl].unsqueeze(1)).to(q.dtype)
    elif u.onehot:  # L_t . L'_s = L'_s[x_t]
        idx = u.left[sl].unsqueeze(1).expand(-1, tv, -1)  # (n, Tv, Tu)
        p = torch.gather(v.left[sl], 2, idx).transpose(1, 2)
    elif v.onehot:
        idx = v.left[sl].unsqueeze(1).expand(-1, tu, -1)  # (n, Tu, Tv)
        p = torch.gather(u.left[sl], 2, idx)
    else:
        p = torch.bmm(u.left[sl], v.left[sl].transpose(1, 2))
    return _vecdot(p.flatten(1).double(), q.flatten(1).double())


def _slices(batch: int, per_example: int) -> list[slice]:
    size = max(1, _TEMP_MAX_NUMEL // max(per_example, 1))
    return [slice(i, min(i + size, batch)) for i in range(0, batch, size)]


def tied_norm_bound(uses: Sequence[TiedUse], rnd: Any, dtype: torch.dtype) -> Tensor:
    """``(B,)`` an upper bound of the norm of the summed vector of a tied parameter per example
    (module docstring), exact up to rounding: the uses' cross terms by ghost inner products.

    ``rnd``: the chunk's rounding constants (``gp(n)``: relative error of a dot product of length
    ``n`` in the working precision). Returned in ``dtype``, rounded up."""
    k = len(uses)
    abs_sums = [_abs_sum(u, rnd) for u in uses]
    batch = abs_sums[0].shape[0]
    total = torch.zeros(batch, dtype=torch.float64, device=abs_sums[0].device)
    mag = torch.zeros_like(total)  # sum of the magnitudes of the terms (for the sum's rounding)
    err_lin = torch.zeros_like(total)  # sum_u eps_u A_u
    for u, a in zip(uses, abs_sums):
        up = (u.bound.double() * (1 + u.rel) + u.eps * a).square()
        total += up
        mag += up
        err_lin += u.eps * a
    for i in range(k):
        for j in range(i + 1, k):
            u, v = uses[i], uses[j]
            tu, tv = u.right.shape[1], v.right.shape[1]
            parts = [_cross(u, v, sl) for sl in _slices(batch, 3 * tu * tv)]
            c = parts[0] if len(parts) == 1 else torch.cat(parts)
            gp_r = 0.0 if (u.onehot or v.onehot) else rnd.gp(u.left.shape[2])
            gp_c = rnd.gp(u.right.shape[2])
            gram = gp_r + gp_c + gp_r * gp_c + _gam64(tu * tv + 1) * (1 + gp_r) * (1 + gp_c)
            e = gram * abs_sums[i] * abs_sums[j]
            total += 2 * (c + e)
            mag += 2 * (c.abs() + e)
    total += _gam64(2 * k * k + 4) * mag  # the float64 sums above
    n = total.clamp(min=0).sqrt() * (1 + 2.0 ** -52) + err_lin * (1 + _gam64(k + 2))
    out = n.to(dtype)
    if dtype != torch.float64:
        up = torch.nextafter(out, torch.full_like(out, math.inf))
        out = torch.where(out.double() < n, up, out)
    return out
