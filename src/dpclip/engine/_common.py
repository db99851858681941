"""Pieces shared by the per-example engines: argument checks and the norm/weight/sum reduction.

The reduction works on one physical chunk of materialized per-example gradients at a time::

    sq[i, g]  = sum over the params p of group g of ||g_{i,p}||^2
    finite_i  = sq[i, :] all finite           (a NaN/Inf coordinate makes the sum non-finite)
    norms     = sqrt(sq), with +inf in every group of a non-finite example
    weights   = weight_fn(norms)               (must have the shape of norms, finite)
    out[p]   += weights[:, group(p)] @ g_p     (non-finite examples contribute a zero vector)

so memory stays at one chunk of per-example gradients whatever the batch size.
"""

from __future__ import annotations

from dpclip.engine import _cm
import contextvars
import gc
import math
import sys
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from dpclip.engine.base import EngineResult, LossFn, ParamGroups, WeightFn
from dpclip.engine.batch import check_batch, first_tensor, owned_slice
from dpclip.engine import frames_guard, torch_names
from dpclip.engine.conv_backends import fixed_conv_backends
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.isolation import Isolated, _flushed, check_structure, engine_only

__all__ = [
    "StepWeights",
    "ChunkReducer",
    "MaterializingEngine",
    "apply_weight_fn",
    "batch_chunks",
    "check_batch",
    "check_chunk_size",
    "check_per_example_model",
    "check_weight_fn",
    "trainable_params",
]


#: half-precision parameter dtypes: their per-example products, weighted sums, norms and weights
#: are computed in float32, and the engines return their sums in float32; ``dp_step`` casts the
#: released (noisy) values to the parameters' dtype. Rounding a sum to float16 / bfloat16 BEFORE
#: the noise is an error relative to the whole batch's sum, not bounded by C (twenty-ninth hostile
#: review: 1.42 C at C = 1.26e-7 in float16), and bfloat16's unit roundoff (2^-8) made every
#: rounding bound of a longer reduction infinite (every norm inf, every weight 0: zero sums).
HALF = (torch.float16, torch.bfloat16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reducer accumulates sums of ``dtype`` in: float64 for float32 (ChunkReducer)."""
    return torch.float64 if dtype == torch.float32 else dtype


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an engine computes and returns the sums of parameters of ``dtype`` in."""
    return torch.float32 if dtype in HALF else dtype


#: set by :func:`wide_sums` (``dp_step``, ``bound_step``): the engines return their float64 sums
#: of float32 and half parameters uncast, and the release casts the NOISY values
_WIDE = contextvars.ContextVar("dpclip_wide_sums", default=False)


@_cm.contextmanager
def wide_sums() -> Iterator[None]:
    """Inside, every engine returns the sums of float32 / float16 / bfloat16 parameters in
    float64, as it accumulated them: the caller adds the noise to those and casts the noisy value
    (post-processing: ``dpclip.training.release``). A cast BEFORE the noise rounds the sum on the
    grid of the whole batch's sum: at most one unit in the last place of ``||S|| <= B C``, which
    a designed batch reached (1.0068 C at B = 2^16, 1.11 C at 2^20; hundred-and-forty-sixth
    hostile review). Each engine reads the setting once, at its entry, before any of the model's
    code runs (:func:`wide_requested`); outside, the engines' results are as documented in
    :class:`~dpclip.engine.base.EngineResult`."""
    token = _WIDE.set(True)
    try:
        yield
    finally:
        _WIDE.reset(token)


def wide_requested() -> bool:
    """Whether the engine being entered returns float64 sums (:func:`wide_sums`)."""
    return _WIDE.get()


def out_dtype(dtype: torch.dtype, wide: bool) -> torch.dtype:
    """The dtype an engine returns the sum of a parameter of ``dtype`` in: float64 for float32
    and half parameters under :func:`wide_sums` (``wide``), else :func:`sum_dtype`."""
    if wide and (dtype == torch.float32 or dtype in HALF):
        return torch.float64
    return sum_dtype(dtype)


def trainable_params(model: nn.Module) -> dict[str, Tensor]:
    """``{name: parameter}`` for every trainable parameter (tied parameters appear once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def check_chunk_size(value: object, owner: str) -> int:
    """Validate ``max_physical_batch`` (a positive int)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: max_physical_batch must be an int >= 1, got {value!r}")
    return value


def batch_chunks(inputs: Any, targets: Any, batch: int,
                 size: int | None) -> Iterator[tuple[int, Any, Any]]:
    """The physical chunks of a batch, in order: ``(rows, xs, ys)`` with ``xs``/``ys`` examples
    ``start:start + rows`` of ``inputs``/``targets`` and ``rows <= size`` (``None``: one chunk).

    ``size`` (``max_physical_batch``) is a public memory knob; ``batch`` (the realised, private
    batch size from :func:`check_batch`) only ends the loop. Every chunk is a copy the engine
    owns (:func:`~dpclip.engine.batch.owned_slice`), a batch that fits one chunk too: the caller
    drops ITS tensors when it likes, after every check, and nothing the model or loss attached to
    what they were handed may run then (the engines drop a chunk inside its isolation); an empty
    batch yields no chunk. No reference to a chunk is kept here once it is yielded.
    """
    step = size or max(batch, 1)
    for start in range(0, batch, step):
        stop = min(start + step, batch)
        yield stop - start, owned_slice(inputs, start, stop), owned_slice(targets, start, stop)


def check_weight_fn(weight_fn: WeightFn | None, engine: str) -> WeightFn:
    if weight_fn is None:
        raise ValueError(
            f"{engine} engine: weight_fn is None, but this engine computes per-example norms and "
            "needs the strategy's weight function (weights = weight_fn(norms)). Pass "
            "`lambda norms: strategy.weights(norms, state)`, or use the 'summed' engine for "
            "bound-based strategies and batch clipping."
        )
    return weight_fn


class StepWeights:
    """A strategy's weight function as :func:`dpclip.training.step.dp_step` hands it to an engine
    that guards the model's state itself (``GhostEngine`` and ``AutoEngine``: the state guard of
    :mod:`dpclip.engine.state_guard` is then entered by the engine, which knows whether any user
    code runs in the step). ``closed``: the strategy's weight function runs no user code
    (``dp_step``'s ``_closed_weights``)."""

    __slots__ = ("fn", "closed")

    def __init__(self, fn: WeightFn, closed: bool) -> None:
        self.fn, self.closed = fn, bool(closed)

    def __call__(self, norms: Tensor) -> Tensor:
        return self.fn(norms)


def check_per_example_model(model: nn.Module, engine: str) -> None:
    """Refuse layers whose output for one example depends on the other examples of the batch.

    A BatchNorm normalizes with batch statistics in training mode (and, without running statistics,
    in eval mode too), so example ``i``'s gradient is not a function of example ``i`` alone and the
    per-example clipping bound does not bound the sensitivity (anchors P12).
    """
    for qualname, mod in model.named_modules():
        if not isinstance(mod, _BatchNorm):
            continue
        uses_batch_stats = mod.training or mod.running_mean is None or mod.running_var is None
        if not uses_batch_stats:
            continue
        where = qualname or "<root>"
        why = (
            "is in training mode"
            if mod.training
            else "has no running statistics (track_running_stats=False), so it uses batch "
            "statistics even in eval mode"
        )
        raise UnsupportedModelError(
            f"{engine} engine: layer {where!r} ({type(mod).__name__}) {why}: per-example clipping is "
            "incompatible with BatchNorm, which mixes the examples of a batch (one example's "
            "gradient depends on the others, so clipping does not bound its influence). Replace it "
            "with GroupNorm (or LayerNorm), or use batch clipping (`--param unit=bc`, summed engine)."
        )


def apply_weight_fn(weight_fn: WeightFn, norms: Tensor, engine: str) -> Tensor:
    """``weight_fn(norms)``, checked: a tensor of the norms' shape with finite entries."""
    weights = weight_fn(norms)
    if not isinstance(weights, Tensor) or weights.shape != norms.shape:
        # ranks, not shapes: dimension 0 is the realised batch size, which is private
        got = (f"a {weights.ndim}-d tensor of another shape" if isinstance(weights, Tensor)
               else type(weights).__name__)
        want = "(B,)" if norms.ndim == 1 else f"(B, {norms.shape[1]}) (one column per group)"
        raise ValueError(
            f"{engine} engine: weight_fn must return a tensor of the norms' shape {want}, "
            f"got {got}"
        )
    # one reduction and one host read in the usual case: a sum is finite iff every term is, unless
    # finite terms overflow it (then the exact elementwise test decides)
    if weights.numel() and not math.isfinite(float(weights.sum())) \
            and not bool(torch.isfinite(weights).all()):
        raise ValueError(
            f"{engine} engine: weight_fn returned non-finite weights; a strategy must map "
            "every norm (including +inf, the norm of a non-finite example) to a finite weight"
        )
    # a weight below the dtype's smallest normal is a subnormal, rounded by up to half its value
    # (C = 1e-44 in float32: LOO 1.24 C, thirty-fourth hostile review): set to 0, which never
    # lets an example exceed its bound (weights are >= 0; a negative one is left to the caller)
    # (float32's at least: a float64 weight for a float32 parameter is multiplied in float32,
    # thirty-fifth hostile review: 2.77 C at C = 1.68e-45)
    # (unconditionally: a test of whether any weight is that small reads a value to the host, a
    # synchronisation per step on a GPU; the where over B weights costs less)
    tiny = max(_tiny(weights.dtype), _TINY32) if weights.is_floating_point() else 0.0
    if weights.numel() and tiny > 0:
        weights = torch.where(weights.abs() < tiny, torch.zeros((), dtype=weights.dtype,
                                                                device=weights.device), weights)
    return weights


def underflow_margin(weights: Tensor, norms: Tensor, absolute: float, covered: float,
                     zero_below: float = 0.0) -> Tensor:
    """The weights lowered so that an ABSOLUTE error of the summed vector stays inside the bound.

    A weighted product ``w g`` (or the book-keeping ``(w b) a``) whose result falls below the
    smallest normal is rounded by up to half the smallest subnormal whatever ``w`` is: per example
    at most ``absolute`` (public sizes) in norm. A term added to the norm is multiplied by the
    weight, so it covers that only for weights of at least ``covered`` (where the engine's norm
    floor, times the weight, is at least ``absolute``); a smaller weight (a tiny clip norm, or a
    huge gradient) is lowered to ``w - absolute / norm``, rounded down and at least 0, so that
    ``w' norm + absolute <= w norm`` (hundred-and-eleventh hostile review: a weight of 6e-37, a
    normal float32, made products of order 2^-150, the rounding then multiplied by inputs of 2^40:
    LOO 50 C at C = 2.5e-34 under ghost, auto and compiled; 1.75 C under vmap and naive at a
    subnormal C). Weights below ``zero_below`` are set to 0: the ghost engine's ``w b`` must be a
    normal number (its rounding is multiplied by ``a`` afterwards, which no absolute term bounds).
    Weights of ``covered`` and above are returned unchanged (the same values as before)."""
    if not weights.numel() or not weights.is_floating_point() or \
            float(weights.min()) >= max(covered, zero_below):
        return weights
    w64 = weights.double()
    lowered = (w64 - absolute / norms.double()).clamp_min_(0.0)
    cast = lowered.to(weights.dtype)
    # (the cast rounds to nearest: one step down where it rounded up)
    cast = torch.where(cast.double() > lowered, torch.nextafter(cast, torch.zeros_like(cast)),
                       cast)
    out = torch.where(weights < covered, cast, weights)
    if zero_below > 0.0:
        out = torch.where(weights < zero_below, torch.zeros_like(out), out)
    return out


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest subnormal of ``dtype``: more than a product loses when it underflows (half
    of it; the half itself is not a float64 for float64)."""
    fi = torch.finfo(dtype)
    return fi.tiny * fi.eps


_TINY: dict[torch.dtype, float] = {}
_TINY32 = torch.finfo(torch.float32).tiny


def _tiny(dtype: torch.dtype) -> float:
    """``torch.finfo(dtype).tiny`` (the smallest normal), cached."""
    got = _TINY.get(dtype)
    if got is None:
        got = _TINY[dtype] = torch.finfo(dtype).tiny
    return got



class UserGenerators(TorchFunctionMode):
    """Around a per-example engine's call of the model: whether the model drew from a
    ``torch.Generator`` of its own (``generator=`` given to a torch function). The engines keep
    the DEFAULT generators per chunk (``vmap``: one batched draw with ``randomness="different"``;
    ``naive``: per example), but not one the model holds: under ``vmap`` one call's draw from it
    gave example i the i-th value of a public sequence (thirtieth hostile review: LOO 2.90-4.88 C
    under vmap and auto), and under ``naive`` a draw count that depends on one example moved the
    next examples' draws (6.40 C). Such a call is refused (:meth:`refuse`)."""

    def __init__(self) -> None:
        super().__init__()
        self.drew: str | None = None

    def see(self, func: Any, kwargs: dict, args: tuple = ()) -> None:
        # (positional too: torch.poisson(rate, g), torch.binomial(n, p, g); thirty-first review)
        if self.drew is None and any(isinstance(v, torch.Generator)
                                     for v in (*args, *kwargs.values())):
            self.drew = getattr(func, "__name__", None) or str(func)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.see(func, kwargs, args)
        return func(*args, **kwargs)

    def refuse(self, engine: str) -> None:
        if self.drew is not None:
            raise UnsupportedModelError(
                f"{engine}: the model drew from a torch.Generator it holds ({self.drew}(..., "
                "generator=...)): the engine gives every example its own draws from the default "
                "generators only, so an example's draws from the model's generator would depend on "
                "its position and on the other examples' draws. Draw from the default generator "
                "(no generator= argument)")

@dataclass(frozen=True)
class _Layout:
    names: tuple[str, ...]  #: trainable parameter names, in model order
    group_of: tuple[int, ...]  #: group index of each name
    n_groups: int
    flat: bool
    dtype: torch.dtype
    device: torch.device


class ChunkReducer:
    """Accumulates ``sum_i w_i g_i`` chunk by chunk; collects norms, weights and the loss sum.

    ``params`` are the trainable parameters (names in ``groups``); ``inputs`` only fixes the dtype
    and device of the norms when nothing is trainable. An example counts as non-finite when one of
    its squared group norms is NaN/Inf: a NaN/Inf coordinate, or a norm that overflows the dtype.
    """

    #: dtype the squared norms are accumulated in (None: the parameters' dtype)
    sq_dtype: torch.dtype | None = None
    #: factor applied to every norm (1: none; > 1: a rounding upper bound, BoundedChunkReducer)
    inflate: float = 1.0
    #: absolute term added to every norm after the factor (underflow: BoundedChunkReducer)
    floor: float = 0.0

    def __init__(
        self,
        params: Mapping[str, Tensor],
        groups: ParamGroups,
        weight_fn: WeightFn,
        engine: str,
        inputs: Any,
    ) -> None:
        for n, p in params.items():
            if p.is_complex():
                # (their sums were kept in complex64 against the running total and their norms
                # failed inside torch's vector_norm by accident: a named refusal instead;
                # hundred-and-sixtieth hostile review)
                raise UnsupportedModelError(
                    f"{engine} engine: trainable parameter {n!r} is {p.dtype}: per-example "
                    "clipping bounds real gradients only (a complex parameter's norm and sum "
                    "are not covered); keep trainable parameters real (a complex layer as two "
                    "real ones)")
        index = {n: g for g, mem in enumerate(groups.members) for n in mem}
        names = tuple(params)
        first = next(iter(params.values()), None)
        inputs = first_tensor(inputs)  # a tensor, or a tuple/dict of tensors (engine.batch)
        self.layout = _Layout(
            names=names,
            group_of=tuple(index[n] for n in names),
            n_groups=len(groups),
            flat=groups.is_flat,
            # norms take the parameters' dtype; with nothing trainable, the inputs' (float) dtype
            dtype=first.dtype if first is not None else (
                inputs.dtype if inputs.is_floating_point() else torch.get_default_dtype()),
            device=first.device if first is not None else inputs.device,
        )
        self.weight_fn = weight_fn
        self.engine = engine
        # the weighted sums accumulated in float64 (float32's products exact there), cast once
        # in result(): a float32 accumulator rounded each chunk's addition on the grid of the
        # running total, and removing one example shifted every later chunk's composition, so
        # the others rounded the other way at every addition (hundred-and-fortieth hostile
        # review: 1.54 C under vmap's defaults at B = 65,536, 5.48 C at max_physical_batch 32,
        # 6.16 C under naive at 2); float64 parameters as they are
        # (under wide_sums: kept in float64, the noise added before the cast)
        wide = wide_requested()
        self._out = {n: out_dtype(p.dtype, wide) for n, p in params.items()}
        self.sums = {n: torch.zeros_like(p, dtype=_acc_dtype(sum_dtype(p.dtype)),
                                         memory_format=torch.contiguous_format)
                     for n, p in params.items()}
        self._norms: list[Tensor] = []
        self._weights: list[Tensor] = []
        self.loss_sum = 0.0

    def _shape(self, b: int) -> tuple[int, ...]:
        return (b,) if self.layout.flat else (b, self.layout.n_groups)

    def _apply_weight_fn(self, norms: Tensor) -> Tensor:
        return apply_weight_fn(self.weight_fn, norms, self.engine)

    def add_chunk(self, per_example: Mapping[str, Tensor], losses: Tensor) -> None:
        """Fold one chunk: ``per_example[name]`` has shape ``(b, *param.shape)``, ``losses`` ``(b,)``."""
        lay = self.layout
        b = int(losses.shape[0])
        flat_grads = [per_example[n].reshape(b, -1) for n in lay.names]
        sq_dtype = self.sq_dtype or lay.dtype
        sq = torch.zeros(b, lay.n_groups, dtype=sq_dtype, device=lay.device)
        for gi, gf in zip(lay.group_of, flat_grads):
            sq[:, gi] += torch.linalg.vector_norm(gf, dim=1, dtype=self.sq_dtype).to(
                sq_dtype).square()
        finite = torch.isfinite(sq).all(dim=1)
        all_finite = bool(finite.all())
        norms = sq.sqrt()
        if self.inflate != 1.0:  # a rounding bound (BoundedChunkReducer): inf when it overflows
            # (float16 in float32: a norm above 256 overflowed, a weight below 6e-5 was a
            # subnormal rounded by up to half its value: twenty-ninth hostile review)
            norms = (norms * self.inflate).to(sum_dtype(lay.dtype))
            if self.floor:  # (twice the term: the addition's own rounding never goes below it)
                norms = norms + 2 * self.floor
        if not all_finite:
            norms = torch.where(finite[:, None], norms, math.inf)
        norms = norms.reshape(self._shape(b))
        weights = self._apply_weight_fn(norms)
        if self.floor:  # (the products w g underflowing: an absolute term, underflow_margin)
            weights = underflow_margin(weights, norms, *self.margin)
        w2 = weights.reshape(b, lay.n_groups)
        for name, gi, gf in zip(lay.names, lay.group_of, flat_grads):
            if not all_finite:
                gf = torch.where(finite[:, None], gf, 0.0)
            acc = self.sums[name].view(-1)
            w = w2[:, gi]
            if acc.dtype != torch.float64:  # (float64 parameters: their sum as it was)
                acc.add_(w.to(gf.dtype) @ gf)
                continue
            # in float64, in row blocks of at most ~8M entries (a float64 copy of a chunk's
            # per-example gradients would double their memory): float32 (or half) products are
            # exact there and the sum over the examples rounds at float64's unit
            w = (w.float() if gf.dtype in HALF else w.to(gf.dtype)).double()
            rows = max(1, min(b, (1 << 23) // max(1, gf.shape[1])))
            for start in range(0, b, rows):
                acc.add_(w[start:start + rows] @ gf[start:start + rows].double())
        self._norms.append(norms)
        self._weights.append(weights)
        self.loss_sum += float(losses.detach().sum())

    def result(self) -> tuple[dict[str, Tensor], Tensor, Tensor, float]:
        """``(grads, norms, weights, loss_sum)``; an empty batch still calls ``weight_fn``."""
        if not self._norms:
            norms = torch.zeros(self._shape(0), dtype=self.layout.dtype, device=self.layout.device)
            self._norms.append(norms)
            self._weights.append(self._apply_weight_fn(norms))
        norms = torch.cat(self._norms) if len(self._norms) > 1 else self._norms[0]
        weights = torch.cat(self._weights) if len(self._weights) > 1 else self._weights[0]
        with exact_float32():  # (the cast with gradual underflow: under the user's
            # flush-to-zero a subnormal sum was flushed, 2.1 C at C = 1.5e-38)
            sums = {n: g if g.dtype == self._out[n] else g.to(self._out[n])
                    for n, g in self.sums.items()}
        return sums, norms, weights, self.loss_sum


#: ``torch.finfo(dtype).eps`` per dtype (a constant of the dtype; ``finfo`` costs ~1 us a call)
_EPS: dict[torch.dtype, float] = {}


def _eps(dtype: torch.dtype) -> float:
    eps = _EPS.get(dtype)
    if eps is None:
        eps = _EPS[dtype] = torch.finfo(dtype).eps
    return eps


@_cm.contextmanager
def exact_float32() -> Iterator[None]:
    """Full float32 products (no TF32, no bfloat16 factors, no autocast) for the engine's own
    arithmetic: the norms, the directly formed gradients and the weighted sums of the ghost
    engine's reduction.

    The rounding bound (:class:`_Rounding`) is read from the same settings, so without this a
    GPU's default TF32 convolutions (``torch.backends.cudnn.allow_tf32``) or a user's
    ``torch.set_float32_matmul_precision("high")`` made every product's relative error 2**-10:
    the cancellation test then sent every example of a convolution to direct forming (all 256
    of a Papernot CNN batch on the CPU under "high": the step 33 % slower). Inside: autocast off on
    the CPU and CUDA (a step run under ``torch.autocast`` computed the engine's Gram matrices in
    bfloat16 while the bound assumed float32: LOO 1.19 C, thirty-seventh hostile review), the
    legacy switches at "highest" / no TF32, every per-backend ``fp32_precision`` that is not IEEE
    set to "ieee" (oneDNN "bf16" convolutions are not covered by the legacy switches), and the
    cyclic garbage collector paused (a finalizer of cyclic garbage runs at any allocation: one
    switched autocast on inside the reduction and off again before its end, 1.19 C). Everything
    is put back exactly; a setting found changed at the end is refused. Where the legacy switches
    cannot be read (torch calls the state a mix of its two APIs), :class:`_Rounding` assumes
    bfloat16 factors (sound, looser). The model's forward and backward never run inside."""
    with _EXACT_LOCK:  # (threads reducing at once would put back each other's settings)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with _exact_inside():
                yield
        finally:
            if collecting:
                gc.enable()


#: one reduction at a time changes the process-wide precision settings
_EXACT_LOCK = threading.RLock()
class _NumpyErrorsOff:
    """numpy's floating-point error handling off (``np.errstate(all="ignore")``) through numpy's
    C-level pieces bound at import: ``np.errstate``'s Python methods (and its module's globals,
    which they look up) would be code a forward could replace and that ran inside the reduction
    (ninety-first hostile review); numpy < 2 (no such pieces): ``np.errstate`` as bound at
    import."""

    __slots__ = ("_token", "_other")

    def __enter__(self) -> None:
        if _NP_EXTOBJ is None:
            self._other = _NP_ERRSTATE(all="ignore")
            self._other.__enter__()
        else:
            self._token = _NP_EXTOBJ[0].set(_NP_EXTOBJ[1](all="ignore"))

    def __exit__(self, *exc: Any) -> bool:
        if _NP_EXTOBJ is None:
            self._other.__exit__(*exc)
        else:
            _NP_EXTOBJ[0].reset(self._token)
        return False


#: numpy's error-state context, as bound at import (numpy < 2: :class:`_NumpyErrorsOff`)
_NP_ERRSTATE = np.errstate
try:  # numpy >= 2: the context variable and the C function np.errstate uses
    from numpy._core import _ufunc_config as _np_ufunc_config

    _NP_EXTOBJ: tuple | None = (_np_ufunc_config._extobj_contextvar,
                                _np_ufunc_config._make_extobj)
except (ImportError, AttributeError):
    _NP_EXTOBJ = None


@_cm.contextmanager
def _exact_inside() -> Iterator[None]:
    """:func:`exact_float32` once the lock is held and the collector paused: autocast (a
    per-thread state) off, then the precision switches."""
    # no trace or profile function inside: one runs on every return of the engine's functions
    # (a profile function the forward set scaled the weights by 50 where apply_weight_fn returned
    # them and removed itself before the chunk's settings were compared: LOO 50 C under ghost,
    # thirty-ninth review); the caller's are put back after
    # (a callback set from C that Python cannot put back, torch.profiler's stack tracer, stays
    # on: frames_guard.callbacks_off; cProfile's is put back by its own enable: before, a step run
    # under cProfile or torch.profiler(with_stack=True) failed with "'Profile' object is not
    # callable")
    found, left = frames_guard.callbacks_off()
    try:
        # (numpy's floating-point error handling off: the reductions' numpy passes, ghost._shrink
        # and ghost_rules._dot64 / _scaled, meet the infinities and NaNs of non-finite examples,
        # which the engine masks; a warning there printed numpy's RuntimeWarning to the user and
        # ran warnings.showwarning, a np.seterrcall function would run inside the reduction)
        with _precise(), _NumpyErrorsOff():
            # the names' check last, after every library context entered above: code any of them
            # ran that replaced a name the arithmetic calls is seen here (ninety-first review)
            torch_names.check("at a reduction")
            yield
            if sys.gettrace() is not left[0] or sys.getprofile() is not left[1]:
                raise UnsupportedModelError(_CHANGED_INSIDE)
    finally:
        if found[0] is not left[0] or found[1] is not left[1]:
            frames_guard.put_back_callbacks(*found)




@_cm.contextmanager
def _precise() -> Iterator[None]:
    """Autocast off, gradual underflow, the precision switches at IEEE (:func:`exact_float32`)."""
    with _cm.ExitStack() as stack:
        for dev in ("cpu", "cuda"):
            if _autocast_on(dev):
                stack.enter_context(torch.autocast(dev, enabled=False))
        # gradual underflow: the underflow floors assume it (a user's set_flush_denormal(True)
        # flushed subnormal partial sums: LOO 2.08 C at C = 1.5e-38, thirty-eighth review)
        flushed = _flushed()[0]
        if flushed:
            torch.set_flush_denormal(False)
        try:
            with _exact_switches():
                yield
                if _autocast_on("cpu") or _autocast_on("cuda") or _flushed()[0]:
                    raise UnsupportedModelError(_CHANGED_INSIDE)
        finally:
            if flushed:
                torch.set_flush_denormal(True)


def _autocast_on(dev: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(dev))
    except RuntimeError:  # (a device type this build does not know)
        return False


_CHANGED_INSIDE = (
    "a float32 precision setting (autocast, flush-to-zero, torch.set_float32_matmul_precision, "
    "allow_tf32, fp32_precision) or an interpreter callback (sys.settrace / sys.setprofile) changed while the engine reduced the step, by code that ran inside it (e.g. "
    "a finalizer of an object the step dropped): the products' rounding bound would not hold; "
    "the settings were put back")


@_cm.contextmanager
def _exact_switches() -> Iterator[None]:
    """The legacy switches at "highest" / no TF32 and every per-backend precision at IEEE (or
    inheriting IEEE), put back exactly; refused if found changed at the end (:func:`exact_float32`)."""
    c = torch._C
    read = getattr(c, "_get_fp32_precision_getter", None)
    write = getattr(c, "_set_fp32_precision_setter", None)
    keys = [(b, o) for b, ops in (("generic", ("all",)), ("mkldnn", _FP32_OPS), ("cuda", _FP32_OPS))
            for o in ops] if read is not None and write is not None else []
    per_backend = [(b, o, read(b, o)) for b, o in keys]

    def legacy() -> tuple | None:
        try:
            return (c._get_float32_matmul_precision(), c._get_cublas_allow_tf32(),
                    c._get_cudnn_allow_tf32())
        except (RuntimeError, AttributeError):
            return None

    old = legacy()
    if old is not None and old != ("highest", False, False):
        torch.set_float32_matmul_precision("highest")
        c._set_cublas_allow_tf32(False)
        c._set_cudnn_allow_tf32(False)
    # (the legacy switches write the per-backend settings; what they leave coarser, oneDNN's
    # convolutions and RNNs, a backend's "all", is set to IEEE here)
    for b, o in keys:
        if read(b, o) not in ("ieee", "none"):
            write(b, o, "ieee")
    ours = [(b, o, read(b, o)) for b, o in keys]
    mine = legacy()
    try:
        yield
        # code that ran inside and changed a switch would make the products coarser than the
        # bound assumes; putting the old values back would also hide the change from the
        # settings watch: refused instead
        if legacy() != mine or any(read(b, o) != v for b, o, v in ours):
            raise UnsupportedModelError(_CHANGED_INSIDE)
    finally:
        if old is not None:
            torch.set_float32_matmul_precision(old[0])
            c._set_cublas_allow_tf32(old[1])
            c._set_cudnn_allow_tf32(old[2])
        # each backend's "all" before its operations (the order of ``keys``)
        for b, o, v in per_backend:
            if read(b, o) != v:
                write(b, o, v)


_FP32_OPS = ("all", "matmul", "conv", "rnn")


class _Rounding:
    """Floating-point error constants of one chunk (Higham, "Accuracy and Stability of Numerical
    Algorithms", 2002, ch. 3): ``u`` the unit roundoff of the working dtype, ``u_p`` the relative
    error of one product inside a matrix product or convolution (``u``, or more when the backend may
    round the factors: TF32 on CUDA, ``torch.set_float32_matmul_precision`` below "highest"),
    ``gam(n) = n u / (1 - n u)`` the relative error of a sum of ``n`` terms in any order, and
    ``gp(n)`` that of a dot product of length ``n`` (each term's error relative to ``|x_k y_k|``).
    A bound that is not valid (``n u >= 1/2``) is ``inf``: the weight is then 0 (sound)."""

    __slots__ = ("u", "u_p", "batch")

    def __init__(self, dtypes: Sequence[torch.dtype], device: torch.device, batch: int) -> None:
        self.u = max(_eps(d) for d in dtypes) / 2
        u_p = self.u
        if self.u <= 2.0 ** -24:  # float32 (or float64) factors may be rounded by the backend
            try:
                # (torch's C getters: the Python wrappers and torch.backends' descriptors look
                # up names a forward could replace, run inside the reduction; ninety-second
                # hostile review)
                prec = torch._C._get_float32_matmul_precision()
                tf32 = device.type == "cuda" and (torch._C._get_cublas_allow_tf32()
                                                  or torch._C._get_cudnn_allow_tf32())
            except RuntimeError:  # (the per-backend API was used: assume the coarsest factors)
                prec, tf32 = "medium", True
            if prec == "medium":
                u_p = max(u_p, 2.0 ** -8)  # bfloat16 factors
            elif prec == "high":
                u_p = max(u_p, 2.0 ** -11)  # TF32 factors
            if tf32:
                u_p = max(u_p, 2.0 ** -11)
        self.u_p = 2 * u_p + u_p * u_p  # both factors rounded
        self.batch = batch

    def gam(self, n: int) -> float:
        nu = n * self.u
        return nu / (1 - nu) if nu < 0.5 else math.inf

    def gp(self, n: int) -> float:
        return self.u_p + self.gam(n) * (1 + self.u_p)

    def bookkeeping(self, n: int) -> float:
        """Relative error (to ``sum_t ||w b_t|| ||a_t||``) of one example's part of a book-keeping
        reduction of length ``n`` with the weights folded into ``b`` (one rounding of ``w b``)."""
        return (1 + self.u) * (1 + self.gp(n)) - 1


class BoundedChunkReducer(ChunkReducer):
    """A :class:`ChunkReducer` whose per-example norms are UPPER BOUNDS of the norms of the
    vectors ``fl(w_i g_i)`` that the weighted sum adds, rounding included, so that a strategy's
    weight ``w_i`` with ``w_i * norm_i <= C`` bounds what is summed (the worst case seen without
    it was 1.00000014 C).

    The squared norms are accumulated in float64 from the gradients' own values (a product of two
    float32 or bfloat16 numbers is exact in float64), so their rounding is
    ``gam64(numel + groups + 8)``; the norm is then rounded to the parameters' dtype (``u``), and
    the factor also covers the product ``w_i g_ij`` inside the weighted reduction over a chunk
    (its factors possibly rounded by the backend: ``u_p``, TF32 on CUDA) and its accumulation,
    bounded relative to each term with the PUBLIC chunk size ``max_physical_batch`` (never the
    realised batch size: an example's weight depends on that example alone), and the strategy's
    few operations on the norm (32). Constants: Higham 2002, ch. 3, as the ghost engine's
    ``_Rounding``. A float64 model gets the same treatment (its norms are exact to ``gam64``)."""

    def __init__(self, params: dict[str, Tensor], groups: ParamGroups, weight_fn: WeightFn,
                 engine: str, inputs: Any, *, chunk: int) -> None:
        super().__init__(params, groups, weight_fn, engine, inputs)
        lay = self.layout
        # every parameter's dtype (float16 / bfloat16: norms, products and sums in float32,
        # HALF): a float64 first parameter set float64's u for float32 products of half ones
        # (thirty-fourth hostile review: 1.000000055 C)
        dtypes = {sum_dtype(p.dtype) for p in params.values()} or {sum_dtype(lay.dtype)}
        rnd = _Rounding(tuple(dtypes), lay.device, chunk)
        u64 = torch.finfo(torch.float64).eps / 2
        longest = max((p.numel() for p in params.values()), default=1)
        n64 = longest + len(params) + lay.n_groups + 8
        g64 = n64 * u64 / (1 - n64 * u64)
        self.sq_dtype = torch.float64  # exact products of float32/bfloat16 values
        self.inflate = ((1 + rnd.u_p) * (1 + rnd.gam(chunk + 32)) * (1 + 2 * g64)
                        / (1 - rnd.u))
        # underflow, which no relative factor covers (thirty-fifth hostile review: float64
        # per-example gradients of ~1e-170 have squares below float64's range, norm 0, weight 1:
        # LOO 1.8e31 C at C = 1e-200 under vmap and naive): each float64 square loses at most
        # float64's smallest normal, each product w g at most its dtype's; public sizes only (the
        # ghost engine's _underflow_floor)
        numel = sum(p.numel() for p in params.values())
        tiny = max((torch.finfo(d).tiny for d in dtypes), default=0.0)
        self.floor = 0.0 if not numel else (  # (nothing trainable: nothing summed, norms 0)
            math.sqrt((numel + lay.n_groups + 8) * torch.finfo(torch.float64).tiny) + numel * tiny)
        # each product w g of the weighted sum loses at most half its dtype's smallest subnormal (counted whole)
        # when it underflows, whatever w: numel of them per example; the floor's ``numel tiny``
        # (twice in the norm) covers that for weights of eps / 4 and more (underflow_margin)
        self.margin = (numel * max(map(smallest_subnormal, dtypes), default=0.0),
                       max((torch.finfo(d).eps for d in dtypes), default=0.0))


#: ``(xs, ys, rows) -> (per-example gradients {name: (rows, *shape)}, losses (rows,))``: one chunk
ChunkGrads = Callable[[Any, Any, int], tuple[Mapping[str, Tensor], Tensor]]


@dataclass(frozen=True)
class MaterializingEngine(ABC):
    """The engines that materialize the per-example gradients of one physical chunk at a time
    (``vmap``, ``naive``): one contract, written once here.

    ``compute`` checks the arguments (a weight function, a batch whose inputs and targets agree,
    no layer that mixes examples, groups that partition the trainable parameters), then folds the
    batch chunk by chunk (at most ``max_physical_batch`` examples, a memory knob) into a
    :class:`ChunkReducer`: norms, ``weights = weight_fn(norms)`` (called once per chunk, so it
    must be row-wise, as every DP weight function is) and ``sum_i w_i g_i``, a non-finite example
    counting with norm ``+inf`` and a zero vector (anchors P7). An empty batch gives zero sums,
    empty norms and one call of ``weight_fn``. A subclass says how one chunk's gradients are
    computed (:meth:`_chunk_grads`) and may compute the norms as bounds (:meth:`_reducer`).
    """

    name: ClassVar[str]
    per_example: ClassVar[bool] = True

    max_physical_batch: int = 256

    def __post_init__(self) -> None:
        check_chunk_size(self.max_physical_batch, type(self).__name__)

    def compute(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                weight_fn: WeightFn | None, groups: ParamGroups) -> EngineResult:
        """See :class:`~dpclip.engine.base.Engine`; ``norms``/``weights`` are ``(B,)`` for one
        group, ``(B, G)`` otherwise."""
        # (no user code runs between the engine's own operations; convolutions on one backend)
        with engine_only(), fixed_conv_backends():
            return self._compute(model, loss_fn, inputs, targets, weight_fn, groups)

    def _compute(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                 weight_fn: WeightFn | None, groups: ParamGroups) -> EngineResult:
        check_structure(model, f"{self.name} engine")  # (before any of the model's methods runs)
        weight_fn = check_weight_fn(weight_fn, self.name)
        batch = check_batch(inputs, targets, self.name)
        check_per_example_model(model, self.name)
        groups.validate(model)
        params = trainable_params(model)
        reducer = self._reducer(params, groups, weight_fn, inputs)
        chunk_grads = self._chunk_grads(model, loss_fn, params)
        for rows, xs, ys in batch_chunks(inputs, targets, batch, self.max_physical_batch):
            with Isolated(model):  # (what a chunk leaves in process state: dpclip.engine.isolation)
                got = chunk_grads(xs, ys, rows)
                del xs, ys  # (the engine's copies, dropped inside the isolation: batch_chunks)
            with exact_float32():  # (a step under autocast: LOO 1.16 C, thirty-eighth review)
                reducer.add_chunk(*got)
        grads, norms, weights, loss_sum = reducer.result()
        return EngineResult(grads=grads, norms=norms, weights=weights, loss_sum=loss_sum)

    def _reducer(self, params: dict[str, Tensor], groups: ParamGroups, weight_fn: WeightFn,
                 inputs: Any) -> ChunkReducer:
        # norms (given to weight_fn and reported): upper bounds of the norms of the vectors
        # actually summed, rounding included, as on the ghost engine (naive too: its norms were
        # taken in the parameters' dtype, a bfloat16 norm 1.0054 times too small, LOO 1.0056 C;
        # float16 at C = 1e-7: 1.72 C; thirty-fourth hostile review)
        return BoundedChunkReducer(params, groups, weight_fn, self.name, inputs,
                                   chunk=self.max_physical_batch)

    @abstractmethod
    def _chunk_grads(self, model: nn.Module, loss_fn: LossFn,
                     params: dict[str, Tensor]) -> ChunkGrads:
        """How one chunk's per-example gradients (of ``params``) and losses are computed."""
