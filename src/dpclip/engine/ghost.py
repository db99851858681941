"""The ghost engine: per-example gradient norms without per-example gradients, and the clipped sum
by book-keeping, from ONE backward pass.

One call of :meth:`GhostEngine.compute` does, per physical chunk of the batch:

1. a forward pass with forward hooks (registered for this call only, removed in a ``finally``) on
   every layer that owns a trainable parameter; each hook stores the layer's input ``a`` and the
   autograd gradient edge of its output (not the output tensor: see ``_Call``). A plain
   ``nn.Sequential`` chain (``_plain_chain``) is run entry by entry instead, recording the same
   calls without hooks;
2. ONE backward pass of the summed per-example loss, ``torch.autograd.grad(sum_i loss_i, edges)``,
   that asks for the gradients ``b`` with respect to the layers' OUTPUTS only: autograd then skips
   every parameter-gradient product, which is exactly the work that book-keeping redoes with weights
   (Bu et al. 2023, "book-keeping");
3. per-example squared norms of every parameter's gradient from ``a`` and ``b`` (the layer rules
   below), reduced to flat or per-group norms; ``weights = weight_fn(norms)``;
4. ``sum_i w_i g_i`` for every parameter from the same ``a`` and ``b`` with the weights folded into
   ``b`` (or, for layers whose per-example gradients were kept, one weighted reduction of those).

Per-layer rules (``a_i``: example ``i``'s input, ``b_i``: gradient of its loss w.r.t. the output;
``T`` positions of a sequence / feature map, ``d``/``p`` input/output width):

* Linear, 2-D input: ``||dW_i||^2 = ||a_i||^2 ||b_i||^2``, ``||db_i||^2 = ||b_i||^2``;
  sum ``dW = (w*b)^T a`` (one matrix product), ``db = w^T b``.
* Linear on sequences (any number of middle dimensions) and Conv1d/Conv2d (positions of the unfolded
  input; any stride, padding, padding mode, dilation and groups), three ways, chosen per layer:
    - ``ghost``: ``||dW_i||^2 = sum_{t,t'} (a_t . a_t')(b_t . b_t')`` from the two Gram matrices
      (``2 T^2 (d+p)`` flops per example, ``T^2`` memory); the sum by book-keeping
      (``(w*b)^T a`` / one convolution weight-gradient with ``w*b``: ``2 T d p`` flops);
    - ``direct``: the per-example gradient ``sum_t b_t a_t^T`` (batched matrix product, or a grouped
      convolution with the batch folded into the groups) is formed, its norm taken, and freed
      (``2 T d p`` flops, ``d p`` memory per example); the sum by book-keeping;
    - ``keep``: like ``direct`` but the per-example gradients are kept and the sum is one weighted
      reduction (``2 d p`` flops) instead of book-keeping.
  The ``mixed`` rule (default; Li et al. 2022 and Bu et al.'s mixed ghost clipping, by cost) keeps
  the layers that save the most flops per kept float while the kept gradients fit in a budget equal
  to the inputs and output gradients the engine holds anyway, and uses ``ghost``
  for the others when ``T (d + p) < d p``, else ``direct``. Biases: ``db_i = sum_t b_t``.
* Embedding: ``||dE_i||^2 = sum_{t,t'} [x_t = x_t'] (b_t . b_t')`` (Gram with an index-equality
  mask) or, for long sequences, the squared norms of per-(example, token) segment sums; the sum by
  ``index_add`` of ``w*b`` (padding_idx rows get nothing, as in PyTorch).
* LayerNorm, RMSNorm, GroupNorm, BatchNorm in eval mode (running statistics): per-example gradients
  are cheap sums over positions (``dgamma_i = sum_t b_t * xhat_t``, ``dbeta_i = sum_t b_t``, the
  shape of the affine parameters) and are kept.
* ``transformers`` Conv1D (GPT-2): the Linear rule on the transposed weight.
* Any other module owning trainable parameters (no rule for its type: ``LlamaRMSNorm``, ViT's
  embeddings with ``cls_token`` / ``position_embeddings``, custom layers): the per-layer path
  (:mod:`dpclip.engine.per_layer`): per-example gradients of its own parameters by ``torch.func``
  on that module, from the same backward's ``b``; kept. ``engine_info["per_layer"]`` names them.
* A parameter used more than once (a layer called several times, tied weights) gets its per-example
  gradient formed for every use and summed (memory ``B * numel``; then the same as ``keep``) while
  ``numel <= _TIED_FORM_MAX_NUMEL``; above it, the exact norm of the sum from the uses' cross
  terms by ghost inner products (Linear / Conv1D weights and biases, Embeddings:
  :mod:`dpclip.engine.tied`), with its rounding bound, or where a use has no cross-term rule the
  sum of the uses' norm bounds (triangle inequality); each use's weighted sum is formed by its own
  rule.
* A ruled layer called without the batch (a ``(1, T)`` position index, broadcast later: BERT,
  GPT-2) has its output expanded to the batch by the forward hook and is then an ordinary batched
  call (:mod:`dpclip.engine.batchless`; the batch-size proof traces the expanded program).
* Frozen parameters (``requires_grad=False``) are not scanned: their modules are not hooked and get
  no norm, no per-example work and no entry in the result (so no noise).

Soundness checks (per call): every trainable parameter must be owned by a module; after the
forward, the autograd graph is walked and each parameter must be used by exactly the hooked layer
calls (a parameter also used functionally elsewhere, e.g. ``F.linear(x, self.fc.weight)``, would
otherwise get part of its gradient silently dropped); and a captured input must not have been
modified in place after its layer used it (an in-place change of a layer's OUTPUT, e.g.
``ReLU(inplace=True)`` right after it, is fine: ``b`` is taken at the layer's own autograd node,
before the change). A violation
raises :class:`~dpclip.engine.errors.UnsupportedModelError` naming the layer, or with
``fallback="vmap"`` runs the ``vmap`` engine on the whole batch and says so in
``EngineResult.engine_info``.

Separability (per call, batches of more than one example): the forward and the loss run under
:class:`~dpclip.engine.separable.SeparabilityTracer`; the per-example losses and every hooked layer's
input must be proved row separable (batch in dimension 0, no example mixing), and the autograd graph
must hold no custom ``autograd.Function``. A model that mixes examples (``x - x.mean(0)``, a softmax
or roll over the batch) or hands a layer the batch in another dimension (sequence-first, even with
``T == B``) is refused or, with ``fallback="vmap"``, run on ``vmap`` (recorded). A plain
``nn.Sequential`` of known ``torch.nn`` classes (``_KNOWN_MODULES``) is proved from the modules'
semantics instead, at every batch size, with configuration and input rank checked per call
(docs/engines.md, "Separability without a trace"); the loss is traced on every call.

Inputs and targets may be tensors or tuples/dicts of tensors (:mod:`dpclip.engine.batch`); every
leaf is marked as example data for the trace.

Rounding: the norms passed to ``weight_fn`` (and reported) are upper bounds of the norms of the
vectors actually summed, rounding included (:class:`_Rounding`, ``_Rule.bound_sq``,
``_position_bound_sq``; docs/engines.md, "Privacy").

References: I. Goodfellow, "Efficient per-example gradient computations", 2015 (2-D linear rule);
X. Li, F. Tramer, P. Liang, T. Hashimoto, "Large language models can be strong differentially
private learners", ICLR 2022 (ghost clipping for sequences); Z. Bu, J. Mao, S. Xu, "Scalable and
efficient training of large convolutional neural networks with differential privacy", NeurIPS 2022
(mixed ghost clipping for convolutions); Z. Bu, Y.-X. Wang, S. Zha, G. Karypis, "Differentially
private optimization on large model at small cost", ICML 2023 (book-keeping).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpclip.engine._common import (
    ChunkReducer,
    _Rounding,
    apply_weight_fn,
    check_batch,
    check_chunk_size,
    check_per_example_model,
    check_weight_fn,
)
from dpclip.engine.base import EngineResult, LossFn, ParamGroups, WeightFn
from dpclip.engine.batch import batch_leaves, call_model, slice_batch
from dpclip.engine.errors import UnsupportedModelError, quote_error
from dpclip.engine.vmap import VmapEngine
from dpclip.engine.per_layer import (
    PerLayerUnsupported,
    arg_batch_dims,
    capture_args,
    check_module_windows,
    elementwise_scale,
    join_layouts,
    module_grads,
    output_tensors,
    scale_grads,
    seq_now,
)
from dpclip.engine.batch_symbol import batch_size_uses, data_independent_paths
from dpclip.engine.batchless import (
    BroadcastGuard, NotBroadcast, expand_rows, is_batchless, is_unbatched)
from dpclip.engine.separable import SeparabilityTracer
from dpclip.engine.tied import TiedUse, tied_norm_bound

__all__ = ["AutoEngine", "GhostEngine", "NORM_MODES", "SUPPORTED_LAYERS", "ghost_support"]

#: per-layer norm strategies: ``mixed`` (cost rule, default), ``ghost`` (Gram matrices wherever a
#: layer has a ghost rule) and ``direct`` (per-example gradients formed and kept); results agree to
#: float rounding, the choice only changes speed and memory.
NORM_MODES = ("mixed", "ghost", "direct")
_FALLBACKS = (None, "vmap")

_vecdot = torch.linalg.vecdot


# ----------------------------------------------------------------------------------- layer calls


class _Call:
    """One hooked call of a layer: its input ``a``, output gradient ``b`` and scratch space.

    The output tensor itself is not kept, only its autograd *gradient edge* (the layer's own
    backward node and output slot) and its shape: keeping the outputs alive until the backward would
    hold every pre-activation tensor of the model (e.g. a Conv's output before its ``tanh``, which
    autograd itself does not save). The gradient that arrives at that edge is the gradient with
    respect to the layer's output as the layer produced it, also when the output is later modified
    in place (``ReLU(inplace=True)``): exactly the ``b`` of the per-layer rules."""

    __slots__ = ("mod", "rule", "owner", "a", "edge", "out_shape", "a_version", "b", "choice",
                 "kept", "layouts", "formed", "outs", "bs", "window", "args", "arg_dims",
                 "live_idx", "fast", "oedges")

    def __init__(self, owner: "_Owner", a: Tensor, out: Tensor,
                 tracer: SeparabilityTracer | None = None) -> None:
        if owner.rule.kind == "module":  # the per-layer path (dpclip.engine.per_layer)
            _init_module_call(self, owner, a, out, tracer)
            return
        #: the separability layouts of the input and output (``(0, 1)``: batch-first, row
        #: separable; see :mod:`dpclip.engine.separable`), or None when the batch was not traced.
        #: The output is then marked ``(0, 1)`` whatever it was: its row ``i`` carries example
        #: ``i``'s share of the parameter gradient, so the trace must also prove that row ``i``
        #: reaches no other example's loss (a data-independent output, e.g. of a position
        #: embedding, flipped over the batch would otherwise pass as a constant)
        if tracer is None:
            self.layouts = None
        else:
            self.layouts = (tracer.layout(a), tracer.layout(out))
            tracer.mark(out, (0, 1))
        self.owner = owner
        self.mod = owner.module
        self.rule = owner.rule
        self.a = a
        self.a_version = a._version
        self.out_shape = tuple(out.shape)
        self.edge = _gradient_edge(out) if out.requires_grad else None
        self.b: Tensor | None = None
        self.choice = "ghost"
        self.kept: dict[str, Tensor] = {}
        #: ``(rows, gradients)``: examples whose weight gradient is formed and summed directly,
        #: not by book-keeping (terms that cancel: ``_position_bound_sq``)
        self.formed: tuple[Tensor, Tensor] | None = None
        self.outs: list[Tensor] | None = None


def _init_module_call(c: _Call, owner: "_Owner", a: Any, out: Any,
                      tracer: SeparabilityTracer | None) -> None:
    """A call of a module on the per-layer path (no rule for its type,
    :mod:`dpclip.engine.per_layer`): its output tensors and their gradient edges (the backward's
    inputs for their ``b``), its arguments (from the pre-hook, ``_Owner.enter``) and the autograd
    sequence-number window of the call are kept until the module's per-example gradients are
    formed. Separability: the outputs must be proved row
    separable by the trace (the module's own operations are traced like any other); they are then
    marked ``(0, 1)`` like a layer's output."""
    all_outs = output_tensors(out)
    c.live_idx = [k for k, t in enumerate(all_outs) if t.requires_grad]
    outs = [all_outs[k] for k in c.live_idx]
    c.owner, c.mod, c.rule = owner, owner.module, owner.rule
    c.a = a if isinstance(a, Tensor) else None
    c.a_version = c.a._version if c.a is not None else 0
    c.outs = outs
    # the outputs' gradient edges as the module produced them (a later in-place change of an
    # output moves the tensor's own edge; b is the gradient w.r.t. the module's output)
    c.oedges = [_gradient_edge(t) for t in outs]
    c.bs = None
    c.out_shape = tuple(outs[0].shape) if outs else ()
    c.edge = outs[0] if outs else None  # "live": the outputs themselves are the grad inputs
    c.b = None
    c.choice = "keep"
    c.kept = {}
    c.formed = None
    start, c.args = owner.starts.pop() if owner.starts else (None, None)
    c.window = (start, seq_now())
    # an RMSNorm-like elementwise scale, recognised from the call's graph: no recomputation
    c.fast = None
    if len(owner.roles) == 1 and len(outs) == 1 and len(all_outs) == 1 and start is not None:
        got = elementwise_scale(outs[0], getattr(owner.module, owner.roles[0]), c.window)
        c.fast = None if got is None else (got[0], got[1], got[0]._version)
    # which captured tensors carry the batch in dimension 0 (sliced per example when the module's
    # per-example gradient is formed): example data by the trace, else the batch-first shape
    c.arg_dims = None if c.args is None else arg_batch_dims(
        c.args[0], c.args[1], None if tracer is None else tracer.layout,
        tracer.batch if tracer is not None
        else (outs[0].shape[0] if outs and outs[0].ndim else -1))
    if tracer is None:
        c.layouts = None
    else:
        lay = join_layouts([tracer.layout(t) for t in outs])
        for t in outs:  # (an output without the batch first is refused by the engine pass)
            if t.ndim and t.shape[0] == tracer.batch:
                tracer.mark(t, (0, 1))
        c.layouts = (lay, lay)


class _Weights:
    """The chunk's weights by group, as ``(B,)`` columns and ``(B, 1)`` views (made once each)."""

    __slots__ = ("weights", "flat", "_cols", "_cols2")

    def __init__(self, weights: Tensor, flat: bool) -> None:
        self.weights = weights
        self.flat = flat
        self._cols: dict[int, Tensor] = {}
        self._cols2: dict[int, Tensor] = {}

    def col(self, g: int) -> Tensor:
        if self.flat:
            return self.weights
        w = self._cols.get(g)
        if w is None:
            w = self._cols[g] = self.weights[:, g]
        return w

    def col2(self, g: int) -> Tensor:
        w = self._cols2.get(g)
        if w is None:
            w = self._cols2[g] = self.col(g).unsqueeze(1)
        return w


_gradient_edge = torch.autograd.graph.get_gradient_edge

#: per-example temporaries of a norm computation (patch matrices, Gram matrices, per-example
#: gradients that are not kept) are formed for at most this many floats at a time, in slices of
#: examples: the peak memory of the norms stays near the tensors the engine holds anyway
_TEMP_MAX_NUMEL = 1 << 22


#: book-keeping reductions (the weighted sums formed from ``a`` and ``b`` over positions) run over
#: blocks of at most this many examples, whose results are then added: the rounding bound of one
#: example's part, ``bookkeeping(_BK_BLOCK * T)`` relative to ``A_i``, is then a function of that
#: example alone (a public constant, not the batch size). A bound that grew with the batch made every
#: example's norm, hence its weight, depend on how many OTHER examples were in the batch: where
#: terms cancel the bound IS the norm, and removing one example from a batch of 6 changed the
#: others' Auto-V weights by ~17% (the neighbouring sums then differed by more than C)
_BK_BLOCK = 64

#: an example whose terms' norms sum to more than this many times its gradient's norm bound
#: (``A_i > _FORM_RATIO * g_i``: the terms cancel) has its weight gradient formed and summed
#: directly (kept) instead of by book-keeping: book-keeping rounds relative to ``w_i A_i``, which
#: the weight only caps at ``~C / bk``; a formed vector is summed with rounding relative to its own
#: entries (``<= C``). Without it, where terms cancel heavily, the OTHER examples' book-keeping
#: rounding, which changes with the batch's composition, moved neighbouring sums by more than C.
#: Random terms give ``A_i / ||G_i|| ~ sqrt(T)``: the default leaves them to book-keeping for up to
#: ~4096 positions
_FORM_RATIO = 64.0


def _bk_blocks(batch: int) -> list[slice]:
    """Slices of ``range(batch)`` of at most ``_BK_BLOCK`` examples (one when it fits)."""
    if batch <= _BK_BLOCK:
        return [slice(0, batch)]
    return [slice(i, min(i + _BK_BLOCK, batch)) for i in range(0, batch, _BK_BLOCK)]


def _bk_sum(batch: int, part: Any) -> Tensor:
    """``sum`` over the book-keeping blocks of ``part(slice)`` (see ``_BK_BLOCK``)."""
    out = None
    for sl in _bk_blocks(batch):
        r = part(sl)
        out = r if out is None else out.add_(r)
    return out  # type: ignore[return-value]


def _example_slices(batch: int, per_example: int) -> list[slice]:
    """Slices of ``range(batch)`` with at most ``_TEMP_MAX_NUMEL`` floats of temporaries each
    (one slice when everything fits; at least one example per slice)."""
    size = max(1, _TEMP_MAX_NUMEL // max(per_example, 1))
    if size >= batch:
        return [slice(0, batch)]
    return [slice(i, min(i + size, batch)) for i in range(0, batch, size)]


def _rows(mask: Tensor, t: Tensor) -> Tensor:
    """``t`` with the rows (examples) where ``mask`` is False set to zero."""
    return torch.where(mask.view(-1, *([1] * (t.ndim - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _kept_sum(g: Tensor, w: Tensor) -> Tensor:
    """``sum_i w_i g_i`` for per-example tensors ``g`` of shape ``(B, *shape)``."""
    return (w.to(g.dtype) @ g.reshape(g.shape[0], -1)).view(g.shape[1:])


def _sq(g: Tensor) -> Tensor:
    """Squared norms of the rows of ``g`` (one fused reduction, no temporary of ``g``'s size)."""
    return torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).square()


class _Rule:
    """How to get per-example norms and weighted sums of one layer type from ``a`` and ``b``."""

    roles: ClassVar[tuple[str, ...]] = ("weight", "bias")
    #: "matmul": a ghost/direct/keep choice by :meth:`dims`; "embedding": Gram or segment sums;
    #: "affine": the (small) per-example gradients are always formed and kept
    kind: ClassVar[str] = "affine"

    def unsupported(self, mod: nn.Module) -> str | None:
        """A reason this configuration of the layer is not supported, or None."""
        return None

    def prepare(self, c: _Call) -> None:
        """Normalise ``c.a`` / ``c.b`` (flatten, pad) once ``c.b`` is known."""

    def dims(self, c: _Call) -> tuple[int, int, int, int] | None:
        """``(T, d_in, d_out, groups)`` of a matmul layer on positions (None: no choice to make)."""
        return None

    def norms(self, c: _Call, roles: Sequence[str]) -> dict[str, Tensor]:
        """Squared per-example norms ``(B,)`` of the gradients of ``roles``; per-example gradients
        that should be reused for the sum go into ``c.kept``."""
        out = {}
        for r in roles:
            g = self.per_example(c, r)
            c.kept[r] = g
            out[r] = _sq(g)
        return out

    def fused_norm(self, c: _Call, roles: Sequence[str]) -> Tensor | None:
        """The sum of the squared norms of ``roles`` in one go, when cheaper (else None)."""
        return None

    def rel_len(self, c: _Call, roles: Sequence[str]) -> int:
        """The length of the longest reduction behind the squared norms of ``roles`` when the
        vector summed for example ``i`` is the very vector whose norm was taken (kept per-example
        gradients, rank-one 2-D Linear gradients): their bound is then relative,
        ``(1 + gam(rel_len))``, applied once per chunk. Layers whose summed vector is formed
        separately (book-keeping over positions) bound themselves in :meth:`bound_sq`."""
        return sum(getattr(c.mod, r).numel() for r in roles) + 4

    def bound_sq(self, c: _Call, sq: Tensor, rnd: _Rounding) -> Tensor | None:
        """For a weight computed by Gram matrices or formed apart from the book-keeping sum: the
        squared upper bound of ``||V_i|| / w_i`` (``V_i`` example ``i``'s part of the weighted sum
        exactly as computed, rounding included) from the computed ``sq``; None: ``sq`` is already
        such a bound up to the chunk's relative factor."""
        return None

    def per_example(self, c: _Call, role: str) -> Tensor:
        """The per-example gradient ``(B, *param.shape)`` of ``role`` from this call."""
        raise NotImplementedError

    def weighted(self, c: _Call, groups: dict[str, int], w: _Weights) -> dict[str, Tensor]:
        """``sum_i w_{i, g(role)} g_i`` for every role in ``groups`` (book-keeping from a, b)."""
        return {r: _kept_sum(self.per_example(c, r), w.col(g)) for r, g in groups.items()}

    def mask(self, c: _Call, finite: Tensor) -> None:
        """Zero the rows of non-finite examples in everything :meth:`weighted` reads."""
        if c.a.is_floating_point():
            c.a = _rows(finite, c.a)
        c.b = _rows(finite, c.b)


def _gam64(n: int) -> float:
    """``gam(n)`` of a float64 sum (the Gram inner products are summed in float64)."""
    nu = n * 2.0 ** -53
    return nu / (1 - nu) if nu < 0.5 else math.inf


def _gram_dot(ga: Tensor, gb: Tensor, groups: int = 1) -> Tensor:
    """``sum_k ga[i, k] gb[i, k]`` per row (summed further over ``groups`` consecutive rows), in
    float64, then rounded UP to the working dtype.

    Products of float32 (or float16/bfloat16) numbers are exact in float64, so the only error is
    that of the float64 sum, ``_gam64(n)`` relative to ``sum |ga gb|``, instead of float32's
    ``gam(n)``: for a sequence of T positions the sum has T^2 terms, and float32's bound
    (T^2 * 6e-8) would make the error term of the ghost norm dominate (and force per-example
    gradients to be formed) for T of a few dozen. Rounding up keeps the value an upper bound of
    the float64 result."""
    exact = _vecdot(ga.flatten(1).double(), gb.flatten(1).double())
    if groups > 1:
        exact = exact.view(-1, groups).sum(1)
    if ga.dtype == torch.float64:
        return exact
    out = exact.to(ga.dtype)
    up = torch.nextafter(out, torch.full_like(out, math.inf))
    return torch.where(out.double() < exact, up, out)


def _position_bound_sq(sq: Tensor, abs_sum: Tensor, choice: str, numel: int, red_len: int,
                       gram_err: float, bk_len: int, rnd: _Rounding,
                       direct: Any = None, form: Any = None) -> Tensor:
    """The squared bound on ``||V_i|| / w_i`` of a layer whose per-example gradient is a sum over
    positions, ``G_i = sum_t b_t a_t^T``, and whose weighted sum is formed by book-keeping.

    ``abs_sum`` is (an upper bound of) ``A_i = sum_t ||a_t|| ||b_t||``, the sum of the norms of the
    terms: every rounding error below is relative to it, not to ``||G_i||``, because the terms can
    cancel (a constant image into a GroupNorm: ``G_i`` ~ 0 while each term is large). Then

    * ghost (``sq`` from Gram matrices): ``||G_i||^2 <= max(sq, 0) + gram_err A^2`` (every entry of
      both Gram matrices and of their inner product has an error below ``gp(.) ||.|| ||.||``, and
      ``sum_{t,t'} ||a_t|| ||a_t'|| ||b_t|| ||b_t'|| = A^2``);
    * direct (``sq`` of the per-example gradient formed over ``red_len`` positions):
      ``||G_i|| <= sqrt(sq) (1 + gam(numel + 2)) + gp(red_len) A``;
    * book-keeping over ``bk_len`` rows with ``w b`` rounded once:
      ``||V_i|| <= w (||G_i|| + bk A)``, and by the triangle inequality also ``<= w (1 + bk) A``.

    The ghost bound's error term is ``sqrt(gram_err) A``; where it dominates (cancellation:
    ``gram_err A^2 > sq / 64``), the examples' gradients are formed directly (``direct(rows)``:
    their squared norms), whose error term is ``gp(red_len) A``, much smaller.

    Where the terms cancel heavily (``A > _FORM_RATIO g``, ``g`` the bound above before
    book-keeping), ``form(rows)`` forms those examples' gradients, stores them for the sum (they are
    then summed directly, not by book-keeping) and returns them: the bound of such an example is
    the norm of its formed gradient, ``sqrt(sq) (1 + gam(numel + 2))`` (the weighted sum of the
    formed gradients is covered by the chunk's relative factor, as for kept gradients).
    """
    bk = rnd.bookkeeping(bk_len)
    if choice == "ghost":
        err = gram_err * abs_sum.square()
        g = (sq.clamp(min=0) + err).sqrt()
        if direct is not None:
            rows = (err * 64 > sq).nonzero().flatten()
            if rows.numel():
                d_sq = direct(rows).to(sq.dtype)
                d_bound = d_sq.sqrt() * (1 + rnd.gam(numel + 2)) + rnd.gp(red_len) * abs_sum[rows]
                g = g.index_put((rows,), torch.minimum(g[rows], d_bound))
    else:
        g = sq.sqrt() * (1 + rnd.gam(numel + 2)) + rnd.gp(red_len) * abs_sum
    bound = torch.minimum(g + bk * abs_sum, (1 + bk) * abs_sum)
    if form is not None:
        rows = ((abs_sum > _FORM_RATIO * g) & torch.isfinite(abs_sum)).nonzero().flatten()
        if rows.numel():
            rows, f_sq = form(rows)
            if rows.numel():
                bound = bound.index_put((rows,),
                                        f_sq.to(sq.dtype).sqrt() * (1 + rnd.gam(numel + 2)))
    return bound.square()


def _store_formed(c: _Call, rows: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Keep the formed weight gradients ``grads`` of the examples ``rows`` (the finite ones) for the
    sum (``c.formed``); returns those rows and their squared norms."""
    ok = torch.isfinite(grads.flatten(1)).all(1)
    if not bool(ok.all()):
        rows, grads = rows[ok], grads[ok]
    c.formed = (rows, grads) if rows.numel() else None
    return rows, _sq(grads)


def _split_formed(c: _Call, w: Tensor) -> tuple[Tensor, Tensor | None]:
    """The weights ``(B,)`` for book-keeping (0 on the formed rows) and the weighted sum of the
    formed gradients (None when there are none)."""
    if c.formed is None:
        return w, None
    rows, grads = c.formed
    return w.index_fill(0, rows, 0), _kept_sum(grads, w[rows])


class _LinearRule(_Rule):
    kind = "matmul"

    def rel_len(self, c: _Call, roles: Sequence[str]) -> int:
        if c.a.ndim == 2:  # ||a||^2 ||b||^2 (+ ||b||^2): two row dot products, one product
            return c.a.shape[1] + c.b.shape[1] + 4
        return super().rel_len(c, roles)

    def bound_sq(self, c: _Call, sq: Tensor, rnd: _Rounding) -> Tensor | None:
        if c.a.ndim == 2 or c.choice == "keep":
            return None
        a, b = c.a, c.b
        batch, t, d, p = a.shape[0], a.shape[1], a.shape[2], b.shape[2]
        na = torch.linalg.vector_norm(a, dim=2)
        nb = torch.linalg.vector_norm(b, dim=2)
        abs_sum = _vecdot(na, nb).to(sq.dtype) * (1 + rnd.gam(max(d, p) + t + 4))
        gram = rnd.gp(d) + rnd.gp(p) + rnd.gp(d) * rnd.gp(p) \
            + _gam64(t * t + 1) * (1 + rnd.gp(d)) * (1 + rnd.gp(p))
        return _position_bound_sq(
            sq, abs_sum, c.choice, d * p, t, gram, _BK_BLOCK * t, rnd,
            lambda rows: _sq(torch.bmm(b[rows].transpose(1, 2), a[rows])),
            lambda rows: _store_formed(c, rows, torch.bmm(b[rows].transpose(1, 2), a[rows])))

    def prepare(self, c: _Call) -> None:
        if c.a.ndim != 2:
            batch = c.a.shape[0]
            c.a = c.a.reshape(batch, -1, c.a.shape[-1])
            c.b = c.b.reshape(batch, -1, c.b.shape[-1])

    def dims(self, c: _Call) -> tuple[int, int, int, int] | None:
        if c.a.ndim == 2:
            return None
        return c.a.shape[1], c.a.shape[2], c.b.shape[2], 1

    def fused_norm(self, c: _Call, roles: Sequence[str]) -> Tensor | None:
        if c.a.ndim != 2 or len(roles) != 2:
            return None
        b2 = _vecdot(c.b, c.b)  # ||a||^2 ||b||^2 + ||b||^2 (rows: one op each)
        return torch.addcmul(b2, _vecdot(c.a, c.a), b2)

    def norms(self, c: _Call, roles: Sequence[str]) -> dict[str, Tensor]:
        a, b = c.a, c.b
        out: dict[str, Tensor] = {}
        if a.ndim == 2:  # Goodfellow: ||b_i a_i^T||^2 = ||a_i||^2 ||b_i||^2
            b2 = _vecdot(b, b)
            if "weight" in roles:
                out["weight"] = _vecdot(a, a) * b2
            if "bias" in roles:
                out["bias"] = b2
            return out
        if "weight" in roles:
            t, d, p = a.shape[1], a.shape[2], b.shape[2]
            if c.choice == "ghost":  # sum_{t,t'} (a_t . a_t')(b_t . b_t')
                parts = []
                for sl in _example_slices(a.shape[0], 2 * t * t):
                    ga = torch.bmm(a[sl], a[sl].transpose(1, 2))
                    gb = torch.bmm(b[sl], b[sl].transpose(1, 2))
                    parts.append(_gram_dot(ga, gb))
                out["weight"] = parts[0] if len(parts) == 1 else torch.cat(parts)
            elif c.choice == "keep":
                g = torch.bmm(b.transpose(1, 2), a)
                out["weight"] = _sq(g)
                c.kept["weight"] = g
            else:
                out["weight"] = torch.cat([_sq(torch.bmm(b[sl].transpose(1, 2), a[sl]))
                                           for sl in _example_slices(a.shape[0], d * p)])
        if "bias" in roles:
            gb = b.sum(1)
            c.kept["bias"] = gb
            out["bias"] = _sq(gb)
        return out

    def per_example(self, c: _Call, role: str) -> Tensor:
        a, b = c.a, c.b
        if role == "bias":
            return b if a.ndim == 2 else b.sum(1)
        if a.ndim == 2:
            return b[:, :, None] * a[:, None, :]
        return torch.bmm(b.transpose(1, 2), a)

    def weighted(self, c: _Call, groups: dict[str, int], w: _Weights) -> dict[str, Tensor]:
        a, b = c.a, c.b
        out: dict[str, Tensor] = {}
        g_w, g_b = groups.get("weight"), groups.get("bias")
        if a.ndim == 2:
            if g_w is not None:
                if a.shape[1] < b.shape[1]:  # scale the narrower of a and b by the weights
                    out["weight"] = torch.mm(b.t(), a * w.col2(g_w))
                else:
                    bw = b * w.col2(g_w)
                    out["weight"] = torch.mm(bw.t(), a)
                    if g_b == g_w:
                        out["bias"] = bw.sum(0)
                        return out
            if g_b is not None:
                out["bias"] = w.col(g_b) @ b
            return out
        if g_w is not None:  # (w*b)^T a over the (example, position) rows of each block
            wb, formed = _split_formed(c, w.col(g_w))
            bw = b * wb.view(-1, 1, 1)
            out["weight"] = _bk_sum(b.shape[0], lambda sl: torch.mm(
                bw[sl].reshape(-1, b.shape[-1]).t(), a[sl].reshape(-1, a.shape[-1])))
            if formed is not None:
                out["weight"].add_(formed)
        if g_b is not None:
            out["bias"] = w.col(g_b) @ b.sum(1)
        return out


class _ConvRule(_Rule):
    """Conv1d / Conv2d. When the layer pads by itself (a padding mode other than zeros, or string
    padding), :meth:`prepare` pads ``c.a`` the same way and the formulas use padding 0."""

    kind = "matmul"

    @staticmethod
    def _padding(c: _Call) -> tuple[int, ...]:
        mod = c.mod
        if isinstance(mod.padding, str) or mod.padding_mode != "zeros":
            return (0,) * (c.a.ndim - 2)
        return tuple(mod.padding)

    def prepare(self, c: _Call) -> None:
        mod = c.mod
        if isinstance(mod.padding, str) or mod.padding_mode != "zeros":
            mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
            c.a = F.pad(c.a, mod._reversed_padding_repeated_twice, mode=mode)

    def dims(self, c: _Call) -> tuple[int, int, int, int]:
        mod = c.mod
        positions = math.prod(c.b.shape[2:])
        return positions, mod.in_channels * math.prod(mod.kernel_size), mod.out_channels, mod.groups

    def _unfold(self, c: _Call, a: Tensor) -> tuple[Tensor, bool]:
        """``(patches, channels_last)``: ``patches`` of shape ``(B * groups, L, fan_in)``, one row
        per output position, ``fan_in = C_in/groups * K`` ordered ``(C, *kernel)`` or, when
        ``channels_last`` (groups == 1), ``(*kernel, C)``.

        Built as a strided view of the (padded) input and copied once by ``reshape`` (``F.unfold``,
        im2col, is one to two orders of magnitude slower on CPU); with one group the input is made
        channels-last first, so that the copy moves runs of ``C`` contiguous values. ``a`` is
        ``c.a`` or a slice of its examples."""
        mod = c.mod
        pad = self._padding(c)
        if any(pad):
            a = F.pad(a, [q for p in reversed(pad) for q in (p, p)])
        nd = a.ndim - 2
        batch, channels, g = a.shape[0], a.shape[1], mod.groups
        channels_last = g == 1 and channels > 1
        if channels_last:
            a = a.movedim(1, -1).contiguous()
            spatial, sp_stride = a.shape[1:-1], a.stride()[1:-1]
        else:
            spatial, sp_stride = a.shape[2:], a.stride()[2:]
        k_size, k_stride, o_size, o_stride = [], [], [], []
        for i in range(nd):
            k, d, st = mod.kernel_size[i], mod.dilation[i], mod.stride[i]
            k_size.append(k)
            k_stride.append(sp_stride[i] * d)
            o_size.append((spatial[i] - d * (k - 1) - 1) // st + 1)
            o_stride.append(sp_stride[i] * st)
        positions = math.prod(o_size)
        fan_in = channels // g * math.prod(mod.kernel_size)
        if channels_last:  # (B, *out, *kernel, C)
            view = a.as_strided([batch] + o_size + k_size + [channels],
                                [a.stride(0)] + o_stride + k_stride + [a.stride(-1)],
                                a.storage_offset())
            return view.reshape(batch, positions, fan_in), True
        # (B, g, C/g, *kernel, *out) -> (B * g, L, fan_in)
        view = a.as_strided([batch, g, channels // g] + k_size + o_size,
                            [a.stride(0), a.stride(1) * (channels // g), a.stride(1)] + k_stride
                            + o_stride, a.storage_offset())
        return view.reshape(batch * g, fan_in, positions).transpose(1, 2), False

    def _weight_grad(self, c: _Call, inp: Tensor, grad_out: Tensor, shape: Sequence[int],
                     groups: int) -> Tensor:
        mod = c.mod
        dummy = grad_out.new_empty(1).expand(*shape)
        return torch.ops.aten.convolution_backward(
            grad_out, inp, dummy, None, mod.stride, self._padding(c), mod.dilation, False,
            [0] * (inp.ndim - 2), groups, [False, True, False])[1]

    def _patch_numel(self, c: _Call) -> int:
        """Floats of one example's patch matrix (fan-in x positions)."""
        mod = c.mod
        return mod.in_channels * math.prod(mod.kernel_size) * math.prod(c.b.shape[2:])

    def _per_example_weight(self, c: _Call, a: Tensor | None = None,
                            b: Tensor | None = None) -> Tensor:
        """Per-example weight gradients of ``c`` (or of the examples in ``a``, ``b``: slices)."""
        mod = c.mod
        a = c.a if a is None else a
        b = c.b if b is None else b
        batch, g = a.shape[0], mod.groups
        cin_g = mod.in_channels // g
        if cin_g > 1 and cin_g * math.prod(mod.kernel_size) * math.prod(b.shape[2:]) \
                <= _PATCH_MAX_NUMEL:
            # small patch matrices: copy them, then one batched matmul per (example, group)
            u, channels_last = self._unfold(c, a)
            bb = b.reshape(batch * g, mod.out_channels // g, -1)
            gw = torch.bmm(bb, u)
            if channels_last:  # (B, C_out, *kernel, C_in) -> (B, C_out, C_in, *kernel)
                gw = gw.view(batch, mod.out_channels, *mod.kernel_size, cin_g).movedim(-1, 2)
                return gw.contiguous()
        else:  # a grouped convolution weight-gradient with the batch folded into the groups
            x = a.reshape(1, batch * a.shape[1], *a.shape[2:])
            go = b.reshape(1, batch * b.shape[1], *b.shape[2:])
            gw = self._weight_grad(c, x, go, (batch * mod.out_channels, cin_g, *mod.kernel_size),
                                   batch * g)
        return gw.view(batch, mod.out_channels, cin_g, *mod.kernel_size)

    def norms(self, c: _Call, roles: Sequence[str]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        batch = c.a.shape[0]
        if "weight" in roles:
            a, b = c.a, c.b
            positions = math.prod(b.shape[2:])
            patches = self._patch_numel(c)
            if c.choice == "ghost":  # Gram matrices of the patches and of the output gradients
                parts = []
                for sl in _example_slices(batch, patches + 2 * positions * positions):
                    u, _ = self._unfold(c, a[sl])
                    ga = torch.bmm(u, u.transpose(1, 2))
                    bb = b[sl].reshape(u.shape[0], -1, u.shape[1])
                    gb = torch.bmm(bb.transpose(1, 2), bb)
                    n = b[sl].shape[0]
                    parts.append(_gram_dot(ga, gb, ga.shape[0] // n))
                out["weight"] = parts[0] if len(parts) == 1 else torch.cat(parts)
            else:
                numel = c.mod.weight.numel()
                slices = _example_slices(batch, patches + numel)
                if c.choice == "keep":
                    if len(slices) == 1:
                        gw = self._per_example_weight(c)
                    else:  # formed slice by slice into the kept tensor
                        gw = b.new_empty((batch, *c.mod.weight.shape))
                        for sl in slices:
                            gw[sl] = self._per_example_weight(c, a[sl], b[sl])
                    out["weight"] = _sq(gw)
                    c.kept["weight"] = gw
                else:
                    out["weight"] = torch.cat([_sq(self._per_example_weight(c, a[sl], b[sl]))
                                               for sl in slices])
        if "bias" in roles:
            gb = c.b.flatten(2).sum(2)
            c.kept["bias"] = gb
            out["bias"] = _sq(gb)
        return out

    def per_example(self, c: _Call, role: str) -> Tensor:
        if role == "bias":
            return c.b.flatten(2).sum(2)
        return self._per_example_weight(c)

    def bound_sq(self, c: _Call, sq: Tensor, rnd: _Rounding) -> Tensor | None:
        if c.choice == "keep":
            return None
        mod, a, b = c.mod, c.a, c.b
        batch, g, nd = a.shape[0], mod.groups, a.ndim - 2
        # ||patch_t||^2 per group: the squares summed over the group's channels, then over each
        # kernel window (a convolution with a kernel of ones, same geometry as the layer)
        a2 = a.square().reshape(batch, g, a.shape[1] // g, *a.shape[2:]).sum(2)
        ones = a2.new_ones((g, 1, *mod.kernel_size))
        conv = F.conv1d if nd == 1 else F.conv2d
        pa2 = conv(a2, ones, None, mod.stride, self._padding(c), mod.dilation, g)
        na = pa2.clamp(min=0).sqrt().reshape(batch, g, -1)
        nb = torch.linalg.vector_norm(b.reshape(batch, g, b.shape[1] // g, -1), dim=2)
        positions = na.shape[2]
        fan_in = a.shape[1] // g * math.prod(mod.kernel_size)
        p = mod.out_channels // g
        abs_sum = (na * nb).sum((1, 2)).to(sq.dtype) * (1 + rnd.gp(fan_in + p + positions * g + 8))
        gram = rnd.gp(fan_in) + rnd.gp(p) + rnd.gp(fan_in) * rnd.gp(p) \
            + _gam64(g * positions * positions + g) * (1 + rnd.gp(fan_in)) * (1 + rnd.gp(p))
        return _position_bound_sq(
            sq, abs_sum, c.choice, mod.weight.numel(), positions, gram, _BK_BLOCK * positions, rnd,
            lambda rows: _sq(self._per_example_weight(c, a[rows], b[rows])),
            lambda rows: _store_formed(c, rows, self._per_example_weight(c, a[rows], b[rows])))

    def weighted(self, c: _Call, groups: dict[str, int], w: _Weights) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        b = c.b
        if "weight" in groups:  # a convolution weight-gradient with the weighted b per block
            wc, formed = _split_formed(c, w.col(groups["weight"]))
            bw = b * wc.view(-1, *([1] * (b.ndim - 1)))
            out["weight"] = _bk_sum(b.shape[0], lambda sl: self._weight_grad(
                c, c.a[sl], bw[sl], c.mod.weight.shape, c.mod.groups))
            if formed is not None:
                out["weight"].add_(formed.view(c.mod.weight.shape))
        if "bias" in groups:
            out["bias"] = w.col(groups["bias"]) @ b.flatten(2).sum(2)
        return out


class _Sub:
    """The rows ``rows`` of a call's ``a`` and ``b`` (for a rule's ``per_example``)."""

    def __init__(self, c: _Call, rows: Tensor) -> None:
        self.a, self.b, self.mod = c.a[rows], c.b[rows], c.mod


class _EmbeddingRule(_Rule):
    roles = ("weight",)
    kind = "embedding"

    def unsupported(self, mod: nn.Module) -> str | None:
        if mod.max_norm is not None:
            return ("max_norm is set (the forward renormalises the weight in place); use "
                    "max_norm=None")
        if mod.scale_grad_by_freq:
            return "scale_grad_by_freq=True (batch-frequency scaling); use scale_grad_by_freq=False"
        return None

    def prepare(self, c: _Call) -> None:
        batch = c.a.shape[0]
        c.a = c.a.reshape(batch, -1)
        b = c.b.reshape(batch, c.a.shape[1], -1)
        if c.mod.padding_idx is not None:  # PyTorch gives the padding row no gradient
            b = b * (c.a != c.mod.padding_idx).unsqueeze(2).to(b.dtype)
        c.b = b

    def norms(self, c: _Call, roles: Sequence[str]) -> dict[str, Tensor]:
        x, b = c.a, c.b
        batch = x.shape[0]
        if c.choice == "ghost":  # sum_{t,t'} [x_t = x_t'] (b_t . b_t')
            gb = torch.bmm(b, b.transpose(1, 2))
            same = (x.unsqueeze(2) == x.unsqueeze(1)).to(gb.dtype)
            return {"weight": _gram_dot(gb, same)}
        # segment sums: the non-zero rows of the per-example gradient, one per (example, token)
        vocab = c.mod.num_embeddings
        key = torch.arange(batch, device=x.device).unsqueeze(1) * vocab + x
        uniq, inv = torch.unique(key.flatten(), return_inverse=True)
        seg = b.new_zeros(uniq.shape[0], b.shape[2]).index_add_(0, inv, b.reshape(-1, b.shape[2]))
        sq = b.new_zeros(batch).index_add_(0, uniq // vocab, _sq(seg))
        return {"weight": sq}

    def per_example(self, c: _Call, role: str) -> Tensor:
        x, b = c.a, c.b
        batch, vocab = x.shape[0], c.mod.num_embeddings
        key = torch.arange(batch, device=x.device).unsqueeze(1) * vocab + x
        out = b.new_zeros(batch * vocab, b.shape[2])
        out.index_add_(0, key.flatten(), b.reshape(-1, b.shape[2]))
        return out.view(batch, vocab, b.shape[2])

    def bound_sq(self, c: _Call, sq: Tensor, rnd: _Rounding) -> Tensor | None:
        b = c.b  # padding positions already zeroed
        batch, t, p = b.shape
        abs_sum = torch.linalg.vector_norm(b, dim=2).sum(1).to(sq.dtype) * (1 + rnd.gam(p + t + 4))
        gram = rnd.gp(p) + _gam64(t * t + 1) * (1 + rnd.gp(p))
        # segment sums: at most t rows per (example, token), then their squared norms summed
        return _position_bound_sq(sq, abs_sum, "ghost" if c.choice == "ghost" else "direct",
                                  p + t, t, gram, _BK_BLOCK * t, rnd,
                                  lambda rows: _sq(self.per_example(_Sub(c, rows), "weight")))

    def weighted(self, c: _Call, groups: dict[str, int], w: _Weights) -> dict[str, Tensor]:
        x, b = c.a, c.b
        bw = b * w.col2(groups["weight"]).unsqueeze(2)
        return {"weight": _bk_sum(b.shape[0], lambda sl: b.new_zeros(
            c.mod.num_embeddings, b.shape[2]).index_add_(0, x[sl].flatten(),
                                                         bw[sl].reshape(-1, b.shape[2])))}

    def mask(self, c: _Call, finite: Tensor) -> None:
        c.b = _rows(finite, c.b)


class _AffineNormRule(_Rule):
    """LayerNorm / RMSNorm (trailing normalized dims), GroupNorm / eval BatchNorm (channel dim 1):
    ``dgamma_i = sum over positions of b * xhat``, ``dbeta_i = sum of b``."""

    def _xhat(self, mod: nn.Module, a: Tensor) -> Tensor:
        raise NotImplementedError

    def _reduce(self, mod: nn.Module, t: Tensor) -> Tensor:
        raise NotImplementedError

    def per_example(self, c: _Call, role: str) -> Tensor:
        if role == "bias":
            return self._reduce(c.mod, c.b)
        return self._reduce(c.mod, c.b * self._xhat(c.mod, c.a))


class _TrailingNormRule(_AffineNormRule):
    def _reduce(self, mod: nn.Module, t: Tensor) -> Tensor:
        k = len(mod.normalized_shape)
        return t.reshape(t.shape[0], -1, *t.shape[t.ndim - k:]).sum(1)


class _LayerNormRule(_TrailingNormRule):
    def _xhat(self, mod: nn.Module, a: Tensor) -> Tensor:
        return F.layer_norm(a, mod.normalized_shape, None, None, mod.eps)


class _RMSNormRule(_TrailingNormRule):
    roles = ("weight",)

    def _xhat(self, mod: nn.Module, a: Tensor) -> Tensor:
        return F.rms_norm(a, mod.normalized_shape, None, mod.eps)


class _ChannelNormRule(_AffineNormRule):
    def _reduce(self, mod: nn.Module, t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], t.shape[1], -1).sum(2)


class _GroupNormRule(_ChannelNormRule):
    def _xhat(self, mod: nn.Module, a: Tensor) -> Tensor:
        return F.group_norm(a, mod.num_groups, None, None, mod.eps)


class _EvalBatchNormRule(_ChannelNormRule):
    """BatchNorm with running statistics in eval mode: a fixed per-channel affine map.
    (Training-mode BatchNorm mixes examples and is refused before we get here.)"""

    def _xhat(self, mod: nn.Module, a: Tensor) -> Tensor:
        return F.batch_norm(a, mod.running_mean, mod.running_var, None, None, False, 0.0, mod.eps)


class _Conv1DRule(_LinearRule):
    """``transformers.pytorch_utils.Conv1D`` (GPT-2's projections): ``y = x @ W + b`` with the
    weight stored ``(in, out)``, the transpose of ``nn.Linear``'s. Every norm and bound is the
    Linear rule's (a transpose keeps norms and entries); per-example and summed weight gradients
    are transposed back to the ``(in, out)`` layout."""

    def norms(self, c: _Call, roles: Sequence[str]) -> dict[str, Tensor]:
        out = super().norms(c, roles)
        kept = c.kept.get("weight")
        if kept is not None:
            c.kept["weight"] = kept.transpose(1, 2)
        return out

    def per_example(self, c: _Call, role: str) -> Tensor:
        g = super().per_example(c, role)
        return g.transpose(1, 2) if role == "weight" else g

    def weighted(self, c: _Call, groups: dict[str, int], w: _Weights) -> dict[str, Tensor]:
        out = super().weighted(c, groups, w)
        if "weight" in out:
            out["weight"] = out["weight"].t()
        return out


class _ModuleRule(_Rule):
    """The per-layer path (:mod:`dpclip.engine.per_layer`): a module with no rule for its type.
    Its per-example gradients are formed from its own call by the engine pass (``c.kept``) and
    kept; the weighted sum is their weighted reduction (relative rounding bound, as ``keep``)."""

    roles = ()
    kind = "module"

    def per_example(self, c: _Call, role: str) -> Tensor:
        return c.kept[role]

    def mask(self, c: _Call, finite: Tensor) -> None:
        """Nothing to do: the kept gradients are masked by the engine."""


_MODULE = _ModuleRule()
_CONV1D = _Conv1DRule()


#: a parameter used by several calls (tied weights) has its per-example gradient formed, exactly,
#: while its ``numel`` is at most this many floats (memory ``B * numel``); beyond it (GPT-2's
#: 38M-entry ``wte`` tied to ``lm_head``), the norm is bounded by the sum of the uses' norm bounds
#: (triangle inequality). The choice depends on the parameter alone, never on the batch size: a
#: choice by ``B * numel`` would change every example's norm, hence weight, when one example is
#: added or removed (the realised batch size is private)
_TIED_FORM_MAX_NUMEL = 1 << 16

#: per-example patch-matrix size (fan-in x positions) up to which per-example conv gradients copy
#: the patches and use one batched matmul; beyond it, or with one input channel per group (slow
#: strided copies), a grouped convolution weight-gradient (no patch copy) is faster on CPU
_PATCH_MAX_NUMEL = 65536
#: reduction length below which per-example (batched) products lose efficiency (cost rule)
_SMALL_REDUCTION = 256
#: sequence length up to which an Embedding's norm uses the (T x T) Gram matrix, beyond which the
#: per-(example, token) segment sums
_EMBED_GRAM_MAX_LEN = 128

_CONV = _ConvRule()
_BATCHNORM = _EvalBatchNormRule()
_RULES: dict[type, _Rule] = {
    nn.Linear: _LinearRule(),
    nn.Conv1d: _CONV,
    nn.Conv2d: _CONV,
    nn.Embedding: _EmbeddingRule(),
    nn.LayerNorm: _LayerNormRule(),
    nn.GroupNorm: _GroupNormRule(),
    nn.BatchNorm1d: _BATCHNORM,
    nn.BatchNorm2d: _BATCHNORM,
    nn.BatchNorm3d: _BATCHNORM,
    nn.SyncBatchNorm: _BATCHNORM,
}
if hasattr(nn, "RMSNorm"):
    _RULES[nn.RMSNorm] = _RMSNormRule()

#: the layer types the ghost engine supports (subclasses too, unless they override ``forward``)
SUPPORTED_LAYERS: tuple[type, ...] = tuple(_RULES)


def _rule_for(mod: nn.Module) -> _Rule | None:
    rule = _RULES.get(type(mod))
    if rule is not None:
        return rule
    if _is_hf_conv1d(mod):
        return _CONV1D
    for base, rule in _RULES.items():
        if isinstance(mod, base) and type(mod).forward is base.forward:
            return rule
    return None


def _is_hf_conv1d(mod: nn.Module) -> bool:
    """Whether ``mod`` is a ``transformers`` ``Conv1D`` (or a subclass keeping its forward), without
    importing ``transformers`` (a model holding one has imported it already)."""
    import sys

    pu = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(pu, "Conv1D", None) if pu is not None else None
    return cls is not None and isinstance(mod, cls) and type(mod).forward is cls.forward


# ------------------------------------------------------------------------------ model scan


class _Owner:
    """A module that owns trainable parameters directly, with the rule for its type."""

    __slots__ = ("name", "module", "rule", "roles", "pnames", "starts")

    def __init__(self, name: str, module: nn.Module, rule: _Rule, roles: tuple[str, ...],
                 pnames: tuple[str, ...]) -> None:
        self.name = name
        self.module = module
        self.rule = rule
        self.roles = roles  #: attribute names of its trainable parameters
        self.pnames = pnames  #: their canonical names (as in ``model.named_parameters()``)
        #: per-layer path: ``(autograd sequence number, captured arguments)`` at the entry of each
        #: call in progress (``enter``), taken by the call's ``_Call``
        self.starts: list[tuple[int, Any]] = []

    def enter(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of a per-layer module: where its call's autograd window starts, and
        its arguments (with their tensors' versions, checked after the forward)."""
        self.starts.append((seq_now(), capture_args(args, kwargs, mod)))


@dataclass(frozen=True)
class _Scan:
    params: dict[str, Tensor]  #: trainable parameters by canonical name, in model order
    owners: tuple[_Owner, ...]
    reasons: tuple[str, ...]  #: why the model is not supported (empty: supported)
    batchnorm: bool  #: the model has a BatchNorm layer
    by_module: dict[int, _Owner]  #: the owners by ``id(module)``
    by_param: dict[int, str]  #: canonical names of the trainable parameters by ``id(param)``
    per_layer: tuple[str, ...] = ()  #: modules on the per-layer path (no rule for their type)


def _scan(model: nn.Module) -> _Scan:
    """One pass over the modules: the trainable parameters (as ``trainable_params``: the names and
    order of ``model.named_parameters()``, tied parameters once), their owners and rules, and the
    reasons the model is unsupported.

    Runs on every call, so that a model changed between calls (``requires_grad_`` toggled, a
    layer or parameter replaced, an Embedding's ``max_norm`` set) is seen as it is. Caching it per
    model was measured and rejected: validating a cache needs the same walk over the modules, and
    the saving on the benchmark MLP (930.9 against 932.7 us per call) was within the noise
    (docs/engines.md, "Fixed cost per call")."""
    params: dict[str, Tensor] = {}
    names: dict[int, str] = {}  # canonical name of every parameter seen, trainable or not
    by_param: dict[int, str] = {}
    owners: list[_Owner] = []
    reasons: list[str] = []
    batchnorm = False
    for qual, mod in model.named_modules():
        if isinstance(mod, _BatchNorm):
            batchnorm = True
        own_params = mod._parameters
        if not own_params:
            continue
        roles: list[str] = []
        pnames: list[str] = []
        for attr, p in own_params.items():
            if p is None:
                continue
            pid = id(p)
            name = names.get(pid)
            if name is None:
                name = names[pid] = f"{qual}.{attr}" if qual else attr
                if p.requires_grad:
                    params[name] = p
                    by_param[pid] = name
            elif pid not in by_param:  # tied, first seen frozen: not trainable
                continue
            if p.requires_grad:  # (tied: named under its first owner)
                roles.append(attr)
                pnames.append(name)
        if not roles:
            continue
        where = qual or "<root>"
        rule = _rule_for(mod)
        if rule is None or any(attr not in rule.roles for attr in roles):
            # no rule for the type (or parameters its rule does not know): the per-layer path
            owners.append(_Owner(where, mod, _MODULE, tuple(roles), tuple(pnames)))
            continue
        why = rule.unsupported(mod)
        if why:
            reasons.append(f"{where!r} ({type(mod).__name__}: {why})")
            continue
        owners.append(_Owner(where, mod, rule, tuple(roles), tuple(pnames)))
    return _Scan(params, tuple(owners), tuple(reasons), batchnorm,
                 {id(o.module): o for o in owners}, by_param,
                 tuple(o.name for o in owners if o.rule is _MODULE))


def ghost_support(model: nn.Module) -> tuple[bool, tuple[str, ...]]:
    """``(supported, reasons)``: whether no module of ``model`` is refused by the static checks
    (a ruled layer in an unsupported configuration, e.g. an Embedding with ``max_norm``), and the
    refusals. Modules without a rule are not refusals: they take the per-layer path
    (:mod:`dpclip.engine.per_layer`; their names: ``engine_info["per_layer"]`` of a result).
    Run-time conditions (a parameter used outside its layer, an in-place change of a
    layer's input after the layer used it, a layer applied to a tensor without the batch dimension first) are
    only detected during :meth:`GhostEngine.compute`."""
    scan = _scan(model)
    return not scan.reasons, scan.reasons


_CUSTOM_FUNCTION = torch.autograd.function.BackwardCFunction


class _RuntimeUnsupported(Exception):
    """A model property found during the forward pass that the ghost rules cannot handle."""


def _graph_param_uses(root: Any, wanted: dict[int, str]) -> dict[str, int]:
    """How many autograd edges lead into each wanted parameter's AccumulateGrad node.

    Raises :class:`_RuntimeUnsupported` on a node of a custom ``torch.autograd.Function`` (or a
    module backward hook, which is one): its backward is user code that the separability trace of
    the forward cannot see, and it could mix the examples' gradients."""
    indeg: dict[Any, int] = {root: 0}
    stack = [root]
    leaves = []
    pop, push, add_leaf = stack.pop, stack.append, leaves.append
    while stack:
        fn = pop()
        if isinstance(fn, _CUSTOM_FUNCTION):
            raise _RuntimeUnsupported(
                f"the autograd graph contains a custom autograd.Function ({type(fn).__name__}) "
                "or a module backward hook, whose backward code could mix the examples' "
                "gradients and is not checked; remove it or use engine 'vmap'")
        edges = fn.next_functions
        if not edges:
            add_leaf(fn)
            continue
        for nxt, _ in edges:
            if nxt is None:
                continue
            n = indeg.get(nxt)
            if n is None:
                indeg[nxt] = 1
                push(nxt)
            else:
                indeg[nxt] = n + 1
    uses: dict[str, int] = {}
    for fn in leaves:
        var = getattr(fn, "variable", None)
        if var is not None:
            name = wanted.get(id(var))
            if name is not None:
                uses[name] = indeg[fn]
    return uses


# --------------------------------------------------------------------------------- the engine


@dataclass(frozen=True)
class GhostEngine:
    """Per-example norms by ghost norms and the weighted sum by book-keeping, from one backward.

    Same contract as :class:`~dpclip.engine.vmap.VmapEngine` (flat or per-group norms, ``+inf`` and
    a zero contribution for non-finite examples, BatchNorm refusal, group validation, empty batches,
    frozen parameters excluded, no mutation of the model), and the same results to float rounding;
    see the module docstring for the per-layer rules.

    Args:
        max_physical_batch: process the batch in chunks of at most this many examples (memory only;
            ``weight_fn`` is called once per chunk, so it must be row-wise, as for ``vmap``).
            ``None`` (default): one chunk.
        norm_mode: ``"mixed"`` (default: per-layer choice by cost), ``"ghost"`` or ``"direct"``
            (see :data:`NORM_MODES`).
        fallback: ``None`` (default): a model with a layer the engine does not support raises
            :class:`~dpclip.engine.errors.UnsupportedModelError` naming it; ``"vmap"``: such a
            batch is computed by the ``vmap`` engine instead, and ``engine_info`` says so.

    Privacy: each example contributes a vector ``V_i`` with ``||V_i|| <= w_i n_i``, ``n_i`` the
    reported norm: an upper bound of the norm of what is actually summed, rounding included, so
    the strategy's sensitivity bound holds. The forward runs on the whole chunk, so it is traced and
    must be proved per-example separable (mixing models and sequence-first layers are refused or
    fall back to ``vmap``); dropout draws independent masks per example, as under ``vmap``. Hooks live for one call only; nothing is
    attached to modules or parameters, ``p.grad`` is not touched.
    """

    name: ClassVar[str] = "ghost"
    per_example: ClassVar[bool] = True

    max_physical_batch: int | None = None
    norm_mode: str = "mixed"
    fallback: str | None = None

    def __post_init__(self) -> None:
        if self.max_physical_batch is not None:
            check_chunk_size(self.max_physical_batch, type(self).__name__)
        if self.norm_mode not in NORM_MODES:
            raise ValueError(f"{type(self).__name__}: norm_mode must be one of {NORM_MODES}, got "
                             f"{self.norm_mode!r}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"{type(self).__name__}: fallback must be None or 'vmap', got "
                             f"{self.fallback!r}")

    # ------------------------------------------------------------------------------- public

    def compute(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: Any,
        targets: Any,
        weight_fn: WeightFn | None,
        groups: ParamGroups,
    ) -> EngineResult:
        weight_fn = check_weight_fn(weight_fn, self.name)
        batch = check_batch(inputs, targets, self.name)
        scan = _scan(model)
        if scan.batchnorm:
            check_per_example_model(model, self.name)
        params = scan.params
        if not _partitions(groups, params):
            groups.validate(model)  # raises, naming the missing / unknown / repeated names
        if scan.reasons:
            return self._unsupported(model, loss_fn, inputs, targets, weight_fn, groups,
                                     "unsupported layer(s): " + "; ".join(scan.reasons))
        if not batch or not params:
            reducer = ChunkReducer(params, groups, weight_fn, self.name, inputs)
            chunk = self.max_physical_batch or max(batch, 1)
            with torch.no_grad():
                for start in range(0, batch, chunk):
                    stop = min(start + chunk, batch)
                    xs, ys = slice_batch(inputs, start, stop), slice_batch(targets, start, stop)
                    reducer.add_chunk({}, _check_losses(loss_fn(call_model(model, xs), ys),
                                                        stop - start))
            grads, norms, weights, loss_sum = reducer.result()
            return EngineResult(grads, norms, weights, loss_sum, self._info(None))
        group_of = {n: g for g, mem in enumerate(groups.members) for n in mem}
        chunk = self.max_physical_batch or batch
        sums: dict[str, Tensor] | None = None
        all_norms, all_weights, loss_sum = [], [], 0.0
        try:
            for start in range(0, batch, chunk):
                stop = min(start + chunk, batch)
                xs, ys = (inputs, targets) if chunk >= batch else (
                    slice_batch(inputs, start, stop), slice_batch(targets, start, stop))
                part, norms, weights, loss = self._chunk(
                    model, scan, group_of, len(groups), loss_fn, xs, ys, stop - start, weight_fn)
                if sums is None:
                    sums = part
                else:
                    for n, g in part.items():
                        sums[n] += g
                all_norms.append(norms)
                all_weights.append(weights)
                loss_sum += loss
        except _RuntimeUnsupported as exc:
            return self._unsupported(model, loss_fn, inputs, targets, weight_fn, groups, str(exc))
        assert sums is not None
        norms = all_norms[0] if len(all_norms) == 1 else torch.cat(all_norms)
        weights = all_weights[0] if len(all_weights) == 1 else torch.cat(all_weights)
        return EngineResult(sums, norms, weights, loss_sum, self._info(None, scan.per_layer),
                            params)

    # ------------------------------------------------------------------------------ helpers

    def _info(self, fallback: str | None, per_layer: tuple[str, ...] = ()) -> dict[str, Any]:
        info = {"engine": "vmap" if fallback else "ghost", "requested": self.name,
                "fallback": fallback}
        if per_layer and not fallback:  # the modules that took the per-layer path (public names)
            info["per_layer"] = per_layer
        return info

    def _unsupported(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                     weight_fn: WeightFn, groups: ParamGroups, reason: str) -> EngineResult:
        if self.fallback == "vmap":
            try:  # the same data-independent library paths as the proof (transformers masks)
                with data_independent_paths():
                    res = VmapEngine(max_physical_batch=self.max_physical_batch or 256).compute(
                        model, loss_fn, inputs, targets, weight_fn, groups)
            except RuntimeError as exc:  # vmap cannot run the model either: say both reasons
                raise UnsupportedModelError(
                    f"{self.name} engine: the ghost engine refused the model ({reason}) and the "
                    f"vmap fallback failed too ({quote_error(exc)}). "
                    "vmap evaluates each example alone and cannot run data-dependent Python "
                    "control flow (e.g. `if mask.all():`) or in-place updates of unbatched "
                    "buffers; make the forward batch-first and free of such branches, or use "
                    "engine 'naive' (a per-example loop, slow)"
                ) from exc
            res.engine_info = self._info(reason)
            return res
        raise UnsupportedModelError(
            f"{self.name} engine: {reason}. The ghost engine has rules for "
            f"{', '.join(t.__name__ for t in SUPPORTED_LAYERS)}, transformers Conv1D (BatchNorm "
            "in eval mode only); other modules with parameters take its per-layer path; every "
            "parameter must be used only inside its own module's forward. Use engine 'auto' or "
            "GhostEngine(fallback='vmap') to fall back to the vmap engine for such models (the "
            "fallback is recorded in engine_info), or engine 'vmap'."
        )

    def _chunk(
        self,
        model: nn.Module,
        scan: _Scan,
        group_of: dict[str, int],
        n_groups: int,
        loss_fn: LossFn,
        xs: Any,
        ys: Any,
        batch: int,
        weight_fn: WeightFn,
    ) -> tuple[dict[str, Tensor], Tensor, Tensor, float]:
        params = scan.params
        calls, total = _forward(model, scan, loss_fn, xs, ys, batch)
        for c in calls:
            o = c.owner
            if c.outs is not None:  # per-layer path: every output batch-first
                bad = [t.ndim for t in c.outs if t.ndim == 0 or t.shape[0] != batch]
                if bad:  # ranks, not shapes: a size could be the (private) batch size
                    raise _RuntimeUnsupported(
                        f"module {o.name!r} ({type(c.mod).__name__}, per-layer path) returned a "
                        f"tensor of rank {bad[0]} whose first dimension is not the batch; "
                        "per-example gradients need batch-first outputs")
                continue
            if c.a_version != c.a._version:
                raise _RuntimeUnsupported(
                    f"the input of layer {o.name!r} ({type(c.mod).__name__}) was modified in "
                    "place after the layer used it (e.g. x.mul_(2) on a tensor a layer has "
                    "consumed); use out-of-place operations")
            if not _batched_rank(c.mod, c.a):
                raise _RuntimeUnsupported(
                    f"layer {o.name!r} ({type(c.mod).__name__}) was called on a tensor of rank "
                    f"{c.a.ndim}, which it reads as ONE unbatched example (e.g. a 2-D input to "
                    "Conv1d): its first dimension is then not the batch; give it the batched "
                    "rank (B, C, ...)")
            if c.a.ndim == 0 or c.a.shape[0] != batch or not c.out_shape \
                    or c.out_shape[0] != batch:
                raise _RuntimeUnsupported(  # ranks, not shapes (the batch size is private)
                    f"layer {o.name!r} ({type(c.mod).__name__}) was called on a tensor of rank "
                    f"{c.a.ndim} (output rank {len(c.out_shape)}) whose first dimension is not "
                    "the batch; per-layer rules need batch-first inputs (e.g. expand position "
                    "indices to (B, T) before an Embedding, or give the layer a leading "
                    "dimension 1 that is broadcast later)")
        live = [c for c in calls if c.edge is not None]
        modular = [c for c in live if c.outs is not None]
        try:
            if total.requires_grad and live:
                uses = _graph_param_uses(total.grad_fn, scan.by_param)
                inputs: list[Any] = []
                for c in live:
                    inputs.extend(c.oedges if c.outs is not None else [c.edge])
                bs = torch.autograd.grad(total, inputs, allow_unused=True)
                k = 0
                for c in live:
                    c.edge = None  # the graph is freed: no node references left behind
                    if c.outs is not None:
                        c.bs = list(bs[k:k + len(c.outs)])
                        c.b = next((b for b in c.bs if b is not None), None)
                        k += len(c.outs)
                    else:
                        c.b = bs[k]
                        k += 1
                live = [c for c in live if c.b is not None]
            else:
                uses, live = {}, []
            # every parameter must be used exactly by the hooked calls that reach the loss (the
            # per-layer path: by the nodes inside its calls, dpclip.engine.per_layer)
            modular = [c for c in live if c.outs is not None]
            count: dict[str, int] = {}
            for c in live:
                if c.outs is None:
                    for pn in c.owner.pnames:
                        count[pn] = count.get(pn, 0) + 1
            if modular:
                mod_names = {pn for c in modular for pn in c.owner.pnames}
                check_module_windows(modular, {pn: uses.get(pn, 0) for pn in mod_names},
                                     {pn: n for pn, n in count.items() if pn in mod_names},
                                     scan.by_param)
                uses = {pn: n for pn, n in uses.items() if pn not in mod_names}
                count_ruled = {pn: n for pn, n in count.items() if pn not in mod_names}
            else:
                count_ruled = count
            if uses != count_ruled:
                bad = sorted(pn for pn in params if uses.get(pn, 0) != count_ruled.get(pn, 0))
                raise _RuntimeUnsupported(
                    f"parameter(s) {', '.join(bad)} are used more often in the autograd graph "
                    "than by the calls of the layers that own them: they are used outside their "
                    "layer's forward (e.g. F.linear(x, self.fc.weight)), which the per-layer "
                    "rules cannot see")
            for c in modular:  # per-example gradients of the per-layer modules' own parameters
                c.kept = scale_grads(c, batch) if c.fast is not None else module_grads(c, batch)
                for pn in c.owner.pnames:
                    count[pn] = count.get(pn, 0) + 1
        except PerLayerUnsupported as exc:
            raise _RuntimeUnsupported(str(exc)) from None
        finally:
            for c in calls:  # no references to the graph or the arguments left behind
                if c.outs is not None:
                    c.outs, c.bs, c.args, c.fast, c.oedges = [], [], None, None, []
        with torch.no_grad():
            return self._reduce(live, count, params, group_of, n_groups, batch, weight_fn, total)

    def _reduce(
        self,
        live: list[_Call],
        count: dict[str, int],
        params: dict[str, Tensor],
        group_of: dict[str, int],
        n_groups: int,
        batch: int,
        weight_fn: WeightFn,
        total: Tensor,
    ) -> tuple[dict[str, Tensor], Tensor, Tensor, float]:
        """Norms, weights and the weighted sum of one chunk from the captured ``a`` and ``b``."""
        for c in live:
            c.rule.prepare(c)
        self._choose(live, batch)
        first = next(iter(params.values()))
        dtype = first.dtype
        dtypes = {dtype}
        for c in live:
            dtypes.add(c.b.dtype)
        rnd = _Rounding(tuple(dtypes), first.device, batch)
        k_rel = 0  # the longest reduction behind a relative bound (see _Rule.rel_len)

        def part_norms(c: _Call, roles: Sequence[str]) -> dict[str, Tensor]:
            nonlocal k_rel
            parts = c.rule.norms(c, roles)
            rel = roles
            if "weight" in parts:
                bound = c.rule.bound_sq(c, parts["weight"], rnd)
                if bound is not None:
                    parts["weight"] = bound
                    rel = [r for r in roles if r != "weight"]
            k_rel = max(k_rel, c.rule.rel_len(c, rel))
            return parts

        # ---- squared norms summed per group (a parameter used by several calls, tied weights:
        # its per-example gradient is formed for every use and summed first, exact, when that
        # numel is at most _TIED_FORM_MAX_NUMEL; else each use's norm bound is taken by its rule and
        # the bounds are added, an upper bound of the norm of the sum by the triangle inequality)
        acc: list[Tensor | None] = [None] * n_groups
        multi: dict[str, Tensor] = {}
        tied: dict[str, Tensor] = {}  # the triangle bound: the sum of the uses' norm bounds
        tied_uses: dict[str, list[tuple[_Call, str]]] = {}
        #: per use: its norm bound and the relative factor that bound still needs
        tied_bounds: dict[str, list[tuple[Tensor, float]]] = {}

        def add(g: int, s: Tensor) -> None:
            acc[g] = s if acc[g] is None else acc[g] + s

        for c in live:
            o = c.owner
            gs = [group_of[pn] for pn in o.pnames]
            single = [count[pn] == 1 for pn in o.pnames]
            if all(single):
                if len(set(gs)) == 1:
                    s = c.rule.fused_norm(c, o.roles)
                    if s is not None:
                        add(gs[0], s)
                        k_rel = max(k_rel, c.rule.rel_len(c, o.roles))
                        continue
                parts = part_norms(c, o.roles)
                for r, g in zip(o.roles, gs):
                    add(g, parts[r])
                continue
            roles = [r for r, one in zip(o.roles, single) if one]
            if roles:
                parts = part_norms(c, roles)
                for r in roles:
                    add(gs[o.roles.index(r)], parts[r])
            for r, pn, one in zip(o.roles, o.pnames, single):
                if one:
                    continue
                if params[pn].numel() > _TIED_FORM_MAX_NUMEL:  # never by the batch size
                    # part_norms for one role, keeping whether the bound is relative
                    sq_u = c.rule.norms(c, [r])[r]
                    b_sq = c.rule.bound_sq(c, sq_u, rnd) if r == "weight" else None
                    rel_u = c.rule.rel_len(c, [r] if b_sq is None else [])
                    k_rel = max(k_rel, rel_u)
                    n_u = (sq_u if b_sq is None else b_sq).clamp(min=0).sqrt()
                    tied[pn] = n_u if pn not in tied else tied[pn] + n_u
                    tied_uses.setdefault(pn, []).append((c, r))
                    tied_bounds.setdefault(pn, []).append(
                        (n_u, rnd.gam(rel_u) if b_sq is None else 0.0))
                    continue
                g = c.rule.per_example(c, r)
                multi[pn] = g if pn not in multi else multi[pn] + g
        for pn, g in multi.items():
            add(group_of[pn], _sq(g))
            k_rel = max(k_rel, g[0].numel() + 4)
        if tied:  # the exact norm of the sum of the uses (cross terms), where it is smaller
            rho_t = _rho(rnd, batch, k_rel, len(live), n_groups)
            for pn in tied:
                exact = _tied_exact(tied_uses[pn], tied_bounds[pn], params[pn], rnd, rho_t)
                if exact is not None:
                    tied[pn] = torch.minimum(tied[pn], exact.to(tied[pn].dtype))
        for pn, n_sum in tied.items():
            add(group_of[pn], n_sum.square())
        zero = None
        for g in range(n_groups):
            if acc[g] is None:
                if zero is None:
                    zero = torch.zeros(batch, dtype=dtype, device=first.device)
                acc[g] = zero
        flat = n_groups == 1
        sq = acc[0] if flat else torch.stack(acc, 1)  # type: ignore[arg-type]
        if sq.dtype != dtype:
            sq = sq.to(dtype)
        # the norms used for the weights are upper bounds of the norms of the vectors actually
        # summed, rounding included (module docstring, "Rounding"): the relative factor covers the
        # norms' own reductions (k_rel), the weighted reduction over the batch (its products
        # rounded: u_p), the sum of the book-keeping blocks (_BK_BLOCK: at most one per example),
        # the addition of the directly formed gradients (_FORM_RATIO: one per layer),
        # the sums over layers and groups, the square root and the strategy's few operations on
        # the norm (32)
        rho = _rho(rnd, batch, k_rel, len(live), n_groups)
        norms = sq.sqrt() * (1 + rho)
        # a sum of non-negative terms is finite iff every term is (or it overflowed: then the
        # exact per-example test below finds every example finite)
        all_finite = math.isfinite(float(sq.sum()))
        finite = None
        if not all_finite:
            finite = torch.isfinite(sq) if flat else torch.isfinite(sq).all(1)
            all_finite = bool(finite.all())
            if not all_finite:
                norms = torch.where(finite if flat else finite[:, None], norms, math.inf)
        weights = apply_weight_fn(weight_fn, norms, self.name)
        wts = _Weights(weights if weights.dtype == dtype else weights.to(dtype), flat)

        # ---- the weighted sum
        if finite is not None and not all_finite:
            for c in live:
                c.rule.mask(c, finite)
                for r, g in c.kept.items():
                    c.kept[r] = _rows(finite, g)
            for pn, g in multi.items():
                multi[pn] = _rows(finite, g)
        sums: dict[str, Tensor] = {}
        for c in live:
            o = c.owner
            todo = {}
            for r, pn in zip(o.roles, o.pnames):
                if count[pn] != 1:
                    continue
                kept = c.kept.get(r)
                if kept is not None:
                    sums[pn] = _kept_sum(kept, wts.col(group_of[pn]))
                else:
                    todo[r] = group_of[pn]
            if todo:
                got = c.rule.weighted(c, todo, wts)
                for r, pn in zip(o.roles, o.pnames):
                    if r in got:
                        sums[pn] = got[r]
        for pn, g in multi.items():
            sums[pn] = _kept_sum(g, wts.col(group_of[pn]))
        for pn, uses_ in tied_uses.items():  # each use's weighted sum, as its rule forms it
            grp = group_of[pn]
            for c, r in uses_:
                kept = c.kept.get(r)
                got = _kept_sum(kept, wts.col(grp)) if kept is not None else \
                    c.rule.weighted(c, {r: grp}, wts)[r]
                got = got.reshape(params[pn].shape)
                sums[pn] = got if pn not in sums else sums[pn] + got
        out = {}
        for pn, p in params.items():
            g = sums.get(pn)
            if g is None:
                g = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif g.shape != p.shape or g.dtype != p.dtype or not g.is_contiguous():
                g = g.reshape(p.shape).to(p.dtype).contiguous()
            out[pn] = g
        return out, norms, weights, total.item()

    def _choose(self, calls: list[_Call], batch: int) -> None:
        """Per-call choice ``ghost`` / ``direct`` / ``keep`` (see the module docstring)."""
        mode = self.norm_mode
        if mode != "mixed":
            choice = "ghost" if mode == "ghost" else "keep"
            for c in calls:
                c.choice = choice
            return
        candidates = []
        budget = 0  # the tensors the engine holds anyway: every call's input and output gradient
        for c in calls:
            kind = c.rule.kind
            if kind == "module":  # per-layer path: per-example gradients formed and kept
                continue
            budget += c.b.numel() + c.a.numel()
            if kind == "embedding":
                c.choice = "ghost" if c.a.shape[1] <= _EMBED_GRAM_MAX_LEN else "direct"
                continue
            if kind != "matmul":
                continue
            dims = c.rule.dims(c)
            if dims is None:
                continue
            t, d_in, d_out, g = dims
            w_numel = d_in * d_out // g
            ghost = 2 * t * t * (d_in + d_out)  # two Gram matrices
            bookkeeping = 2 * t * w_numel  # one large matrix product / convolution weight-grad
            # the per-example gradients: the same flops in B small products whose reduction
            # dimension is t, which run several times slower than one large product when t is
            # small (measured on CPU: ~4x at t = 64, ~1x from t = 256 on)
            direct = bookkeeping * max(1.0, _SMALL_REDUCTION / t)
            c.choice = "ghost" if ghost < direct else "direct"
            # keeping them replaces the book-keeping product by a weighted reduction
            saving = min(ghost, direct) + bookkeeping - (direct + 2 * w_numel)
            if saving > 0:
                candidates.append((saving / w_numel, batch * w_numel, c))
        candidates.sort(key=lambda s: -s[0])
        used = 0
        for _, mem, c in candidates:
            if used + mem <= budget:
                c.choice = "keep"
                used += mem


def _rho(rnd: _Rounding, batch: int, k_rel: int, n_live: int, n_groups: int) -> float:
    """The chunk's relative rounding factor of the norms (see ``GhostEngine._reduce``)."""
    n_blocks = len(_bk_blocks(batch))
    return (1 + rnd.u_p) * (1 + rnd.gam(batch + n_blocks + k_rel + 3 * n_live + n_groups
                                        + 32)) - 1


def _tied_exact(uses: list[tuple[_Call, str]], bounds: list[tuple[Tensor, float]],
                param: Tensor, rnd: _Rounding, rho: float) -> Tensor | None:
    """The exact norm bound of a tied parameter's summed vector from the cross terms of its uses
    (:mod:`dpclip.engine.tied`), or None when a use is not of a kind it handles (a convolution,
    an affine norm, the per-layer path: the triangle bound stays). Linear / Conv1D biases are
    ``sum_t b_t 1^T``."""
    if param.ndim not in (1, 2):
        return None
    rows, cols = param.shape[0], (param.shape[1] if param.ndim == 2 else 1)
    got = []
    for (c, r), (n_u, rel) in zip(uses, bounds):
        rule = c.rule
        a, b = c.a, c.b
        if isinstance(rule, _EmbeddingRule) and r == "weight":  # a (B, T) ids, b (B, T, p)
            onehot, left, right = True, a, b
        elif isinstance(rule, _LinearRule):  # Linear and transformers Conv1D (prepared: 2-D/3-D)
            if a.ndim == 2:
                a, b = a.unsqueeze(1), b.unsqueeze(1)
            onehot = False
            if r == "bias":  # sum_t b_t = sum_t b_t 1^T
                left, right = b, b.new_ones(b.shape[0], b.shape[1], 1)
            else:
                left, right = (a, b) if isinstance(rule, _Conv1DRule) else (b, a)
            if left.shape[2] != rows:
                return None
        else:
            return None
        if right.shape[2] != cols or (r == "bias") != (param.ndim == 1):
            return None
        bk = rnd.bookkeeping(_BK_BLOCK * right.shape[1])
        got.append(TiedUse(onehot, left, right, n_u, rel, (1 + bk) * (1 + rho) - 1))
    return tied_norm_bound(got, rnd, param.dtype)


def _partitions(groups: ParamGroups, params: dict[str, Tensor]) -> bool:
    """Whether ``groups`` holds every trainable parameter exactly once and nothing else (what
    ``groups.validate`` checks, from the names already scanned)."""
    members = groups.members
    if len(members) == 1:
        return members[0] == tuple(params) or (
            len(members[0]) == len(params) and set(members[0]) == params.keys())
    names = [n for mem in members for n in mem]
    return len(names) == len(params) and set(names) == params.keys()


def _check_losses(losses: Tensor, batch: int) -> Tensor:
    if losses.ndim == 0 or losses.shape[0] != batch:
        from dpclip.engine.errors import loss_shape_error

        raise loss_shape_error(losses.ndim)
    return losses.reshape(batch, -1).sum(1) if losses.ndim > 1 else losses


_module_mod = torch.nn.modules.module


def _no_hooks(mod: nn.Module) -> bool:
    return not (mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks
                or mod._backward_pre_hooks)


def _plain_chain(model: nn.Module, by_module: dict[int, "_Owner"]) -> list[nn.Module] | None:
    """The modules that ``model(x)`` applies one after the other, when ``model`` is a plain chain:
    an ``nn.Sequential`` (exactly that type, nested ones flattened) of leaf modules, without hooks
    on the containers or on the layers that own trainable parameters, and no global module hooks.
    Then running the chain ourselves sees every owner call with its input and output exactly as
    forward hooks would, at a fraction of the cost (hooks put every call of a hooked module on
    PyTorch's slow path). ``None``: use hooks."""
    if type(model) is not nn.Sequential or not _no_hooks(model):
        return None
    if (_module_mod._global_forward_hooks or _module_mod._global_forward_pre_hooks
            or _module_mod._global_backward_hooks or _module_mod._global_backward_pre_hooks):
        return None
    chain: list[nn.Module] = []
    stack = [iter(model._modules.values())]
    while stack:
        mod = next(stack[-1], _END)
        if mod is _END:
            stack.pop()
            continue
        if mod is None:  # not callable: let the ordinary forward raise its own error
            return None
        if type(mod) is nn.Sequential:
            if not _no_hooks(mod):
                return None
            stack.append(iter(mod._modules.values()))
        elif mod._modules:  # a container of another kind: its calls are its own business
            return None
        elif id(mod) in by_module and (not _no_hooks(mod) or by_module[id(mod)].rule is _MODULE):
            return None
        else:
            chain.append(mod)
    return chain


_END = object()


def _engine_call(owner: "_Owner", a: Tensor, out: Tensor,
                 tracer: SeparabilityTracer | None) -> _Call:
    """A :class:`_Call` recorded from inside the traced forward: the engine's own code (it reads
    ``grad_fn`` for the gradient edge) is not user code, so the tracer's Python checks pause."""
    if tracer is None:
        return _Call(owner, a, out, None)
    quiet, tracer.quiet = tracer.quiet, True
    try:
        return _Call(owner, a, out, tracer)
    finally:
        tracer.quiet = quiet


def _forward(model: nn.Module, scan: _Scan, loss_fn: LossFn, xs: Any,
             ys: Any, batch: int) -> tuple[list[_Call], Tensor]:
    """The hooked forward pass: ``(calls, sum of the per-example losses)``; hooks removed after.
    ``xs``/``ys``: tensors, or tuples/dicts of tensors (:mod:`dpclip.engine.batch`)."""
    # a batch of one example cannot mix examples; otherwise every operation is traced, and the
    # batch size, private, must be used only as the leading dimension (proved once per signature
    # with a symbolic batch size; the real forward then takes the same data-independent paths)
    if batch > 1:
        # the ruled layers' batch-less calls are expanded to the batch (dpclip.engine.batchless):
        # the proof traces the program the engine runs
        why = batch_size_uses(model, loss_fn, xs, ys, tuple(
            (o.module, o.rule is _MODULE) for o in scan.owners))
        with data_independent_paths():  # first: an error of the user's own code surfaces as is
            got = _forward_traced(model, scan, loss_fn, xs, ys, batch)
        if why is not None:
            raise _RuntimeUnsupported(
                f"the forward pass and loss are not proved per-example separable: {why}. The "
                "realised batch size is private: normalise by a public constant (the expected "
                "batch size) outside loss_fn, or use engine 'vmap'")
        return got
    return _forward_traced(model, scan, loss_fn, xs, ys, batch)


def _forward_traced(model: nn.Module, scan: _Scan, loss_fn: LossFn, xs: Any,
                    ys: Any, batch: int) -> tuple[list[_Call], Tensor]:
    calls: list[_Call] = []
    by_module = scan.by_module
    chain = _plain_chain(model, by_module) if isinstance(xs, Tensor) else None
    tracer = SeparabilityTracer(batch) if batch > 1 else None
    if tracer is not None:  # every leaf of the inputs and targets is example data, batch first
        for t in batch_leaves(xs, "inputs") + batch_leaves(ys, "targets"):
            tracer.mark(t, (0, 1))
    if chain is not None:  # the same calls as the hooks would see, without hooks
        if tracer is not None and _known_chain(chain):
            got = _run_known_chain(chain, by_module, xs, batch)
            if got is not None:  # proved per-example separable by the modules' semantics
                calls, h = got
                tracer.mark(h, (0, 1))
                with torch.enable_grad(), tracer:  # the loss is user code: traced every call
                    losses = _check_losses(loss_fn(h, ys), batch)
                _check_separable(tracer, calls, losses)
                return calls, losses.sum()
        key = _chain_key(chain, xs) if tracer is not None else None
        cached = _CHAIN_LAYOUTS.get(key) if key is not None else None
        chain_tracer = tracer if cached is None else None
        with torch.enable_grad():
            with chain_tracer or contextlib.nullcontext():
                h = xs
                for mod in chain:
                    owner = by_module.get(id(mod))
                    if owner is None:
                        h = mod(h)
                    else:
                        out = mod(h)
                        calls.append(_engine_call(owner, h, out, chain_tracer))
                        h = out
            if tracer is not None:
                if cached is not None:
                    for c, lay in zip(calls, cached[0]):
                        c.layouts = lay
                    tracer.mark(h, cached[1])
                elif key is not None and tracer.violation is None:
                    if len(_CHAIN_LAYOUTS) >= 256:
                        _CHAIN_LAYOUTS.clear()
                    _CHAIN_LAYOUTS[key] = (tuple(c.layouts for c in calls), tracer.layout(h))
            with tracer or contextlib.nullcontext():  # the loss is user code: traced every call
                losses = _check_losses(loss_fn(h, ys), batch)
        _check_separable(tracer, calls, losses)
        return calls, losses.sum()

    expanded: list[str] = []  # layers whose batch-less calls were expanded
    guard = BroadcastGuard(batch)  # uses of expanded outputs that had no leading 1

    def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        a = args[0] if args else next(iter(kwargs.values()), None)
        owner = by_module[id(mod)]
        _refuse_user_forward_hooks(owner.name, mod, hook)
        per_layer = owner.rule is _MODULE
        if tracer is not None and is_batchless(a, out, per_layer):
            # a call without the batch (a (1, T) position index, a (1, T, d) table): its output
            # (and a ruled layer's input) as batched views, the output returned in place of the
            # original (dpclip.engine.batchless); the trace sees the expansion, the call reads the
            # view's layout, then marks it (0, 1)
            if not per_layer:
                a = expand_rows(a, batch)
            out = expand_rows(out, batch)
            expanded.append(owner.name)
            calls.append(_engine_call(owner, a, out, tracer))
            return out
        if not per_layer and is_unbatched(a, out, batch, lambda: _constant(tracer, a)):
            # no batch dimension and no leading 1 (an Embedding on a 1-D arange(T)): expanded
            # with an extra leading B, every later use guarded (dpclip.engine.batchless)
            user = tuple(out.shape)
            a = a.unsqueeze(0).expand(batch, *a.shape)
            out = out.unsqueeze(0).expand(batch, *out.shape)
            expanded.append(owner.name)
            calls.append(_engine_call(owner, a, out, tracer))
            guard.start()
            guard.guard(out, owner.name, user)
            return out
        calls.append(_engine_call(owner, a, out, tracer))
        return None

    def enter(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        # the engine's own code (it reads the autograd sequence number), not user code: the
        # tracer's Python checks pause, as in _engine_call
        if tracer is None:
            return by_module[id(mod)].enter(mod, args, kwargs)
        quiet, tracer.quiet = tracer.quiet, True
        try:
            by_module[id(mod)].enter(mod, args, kwargs)
        finally:
            tracer.quiet = quiet

    handles = []
    try:
        for o in scan.owners:
            handles.append(o.module.register_forward_hook(hook, with_kwargs=True))
            if o.rule is _MODULE:  # the per-layer path needs the call's autograd window
                handles.append(o.module.register_forward_pre_hook(enter, with_kwargs=True))
        try:
            with torch.enable_grad(), (tracer or contextlib.nullcontext()):
                try:
                    losses = _check_losses(loss_fn(call_model(model, xs), ys), batch)
                finally:
                    guard.stop()  # (pushed by the hook at the first guarded output, if any)
        except NotBroadcast as exc:
            raise _RuntimeUnsupported(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - only where the engine changed the program
            if not expanded:
                raise
            raise _RuntimeUnsupported(
                f"layer {expanded[0]!r} was called without the batch dimension (leading "
                "dimension 1) and the forward pass failed on its output expanded to the batch "
                f"({type(exc).__name__}); the ghost engine reads per-example gradients of such "
                "a call from the expanded output: let the code after the layer broadcast it "
                "(e.g. x + pos), or use engine 'vmap'") from exc
    finally:
        for h in handles:
            h.remove()
    _check_separable(tracer, calls, losses)
    return calls, losses.sum()


def _constant(tracer: SeparabilityTracer | None, a: Tensor) -> bool:
    """Whether ``a`` is constant for the trace (True without a trace: a batch of one); the
    engine's own read, with the tracer's Python checks paused (it reads the storage)."""
    if tracer is None:
        return True
    quiet, tracer.quiet = tracer.quiet, True
    try:
        return tracer.layout(a) is None
    finally:
        tracer.quiet = quiet


# ------------------------------------------------------- chains of known modules (no trace)
#
# A plain chain made only of the modules below is proved per-example separable from the modules'
# documented semantics instead of by tracing its operations, at every batch size, without a cache.
# Each entry is an EXACT ``torch.nn`` class (not a subclass: a subclass may override any method the
# forward calls) whose forward applies one fixed function to every example of a batch-first input
# independently, given the module's configuration, which the predicate checks together with the
# rank of the input it is about to receive (the rank at which the documented batch dimension is
# dimension 0; a wrong rank, e.g. a 3-D tensor given to Conv2d, which reads it as ONE unbatched
# example, is not proved and goes to the tracer). Nothing in these forwards reads the batch size
# or the data, so the verdict cannot change with the batch size, the step or the values. Run-time
# conditions are checked on every call: no hooks (module or global), no instance attribute
# ``forward``, the output a tensor with the batch first. See docs/engines.md, "Separability
# without a trace".


def _rank_at_least(k: int) -> Callable[[nn.Module, Tensor], bool]:
    return lambda mod, x: x.ndim >= k


def _rank(k: int) -> Callable[[nn.Module, Tensor], bool]:
    return lambda mod, x: x.ndim == k


def _softmax_ok(mod: nn.Module, x: Tensor) -> bool:
    return mod.dim is not None and x.ndim >= 2 and mod.dim % x.ndim != 0


def _flatten_ok(mod: nn.Module, x: Tensor) -> bool:
    return x.ndim >= 2 and mod.start_dim % x.ndim >= 1 and mod.end_dim % x.ndim >= \
        mod.start_dim % x.ndim


def _unflatten_ok(mod: nn.Module, x: Tensor) -> bool:
    return isinstance(mod.dim, int) and x.ndim >= 2 and mod.dim % x.ndim >= 1


def _trailing_norm_ok(mod: nn.Module, x: Tensor) -> bool:
    return x.ndim > len(mod.normalized_shape)


def _embedding_ok(mod: nn.Module, x: Tensor) -> bool:
    return mod.max_norm is None and x.ndim >= 1


def _eval_batchnorm_ok(mod: nn.Module, x: Tensor) -> bool:
    return not mod.training and mod.running_mean is not None and mod.running_var is not None \
        and x.ndim >= 2


def _no_indices(k: int) -> Callable[[nn.Module, Tensor], bool]:
    return lambda mod, x: x.ndim == k and not getattr(mod, "return_indices", False)


_POINTWISE_MODULES = (
    "Identity", "ReLU", "ReLU6", "LeakyReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish",
    "Tanh", "Sigmoid", "Hardtanh", "Hardsigmoid", "Hardswish", "Softplus", "Softsign",
    "Tanhshrink", "LogSigmoid", "Dropout", "AlphaDropout",
)
_KNOWN_MODULES: dict[type, Callable[[nn.Module, Tensor], bool]] = {
    getattr(nn, name): _rank_at_least(1) for name in _POINTWISE_MODULES if hasattr(nn, name)}
_KNOWN_MODULES.update({
    nn.Linear: _rank_at_least(2),
    nn.Conv1d: _rank(3),
    nn.Conv2d: _rank(4),
    nn.Embedding: _embedding_ok,
    nn.LayerNorm: _trailing_norm_ok,
    nn.GroupNorm: _rank_at_least(2),
    nn.BatchNorm1d: _eval_batchnorm_ok,
    nn.BatchNorm2d: _eval_batchnorm_ok,
    nn.Softmax: _softmax_ok,
    nn.LogSoftmax: _softmax_ok,
    nn.Softmin: _softmax_ok,
    nn.Flatten: _flatten_ok,
    nn.Unflatten: _unflatten_ok,
    nn.MaxPool1d: _no_indices(3),
    nn.MaxPool2d: _no_indices(4),
    nn.AvgPool1d: _rank(3),
    nn.AvgPool2d: _rank(4),
    nn.AdaptiveAvgPool1d: _rank(3),
    nn.AdaptiveAvgPool2d: _rank(4),
    nn.AdaptiveMaxPool1d: _no_indices(3),
    nn.AdaptiveMaxPool2d: _no_indices(4),
    nn.ZeroPad2d: _rank(4),
    nn.ConstantPad1d: _rank(3),
    nn.ConstantPad2d: _rank(4),
})
if hasattr(nn, "RMSNorm"):
    _KNOWN_MODULES[nn.RMSNorm] = _trailing_norm_ok


def _batched_rank(mod: nn.Module, a: Tensor) -> bool:
    """Whether a supported layer (or a subclass keeping its forward) receives its BATCHED rank,
    the rank at which its documented batch dimension is dimension 0."""
    for cls in type(mod).__mro__:
        pred = _KNOWN_MODULES.get(cls)
        if pred is not None:
            return pred(mod, a) or isinstance(mod, _BatchNorm)  # BatchNorm checks its own rank
    return True


def _known_chain(chain: list[nn.Module]) -> bool:
    """Whether every module of the chain is of a known exact class, without hooks (container
    and global hooks are excluded by :func:`_plain_chain`) or an instance ``forward``."""
    for mod in chain:
        if type(mod) not in _KNOWN_MODULES or not _no_hooks(mod) or "forward" in mod.__dict__:
            return False
    return True


def _run_known_chain(chain: list[nn.Module], by_module: dict[int, "_Owner"], xs: Tensor,
                     batch: int) -> tuple[list[_Call], Tensor] | None:
    """Run a chain of known modules, checking each module's predicate on the input it receives
    and that its output has the batch first; the calls with the layouts ``(0, 1)`` they are
    proved to have, and the output. ``None`` when a check fails (the caller then traces)."""
    calls: list[_Call] = []
    h = xs
    with torch.enable_grad():
        for mod in chain:
            if not _KNOWN_MODULES[type(mod)](mod, h):
                return None
            out = mod(h)
            if not isinstance(out, Tensor) or out.ndim == 0 or out.shape[0] != batch:
                return None
            owner = by_module.get(id(mod))
            if owner is not None:
                c = _Call(owner, h, out)
                c.layouts = ((0, 1), (0, 1))
                calls.append(c)
            h = out
    return calls, h


#: separability layouts of plain chains of built-in modules, by :func:`_chain_key`: ``(layouts of
#: the hooked calls, layout of the chain's output)``. Sound to reuse: a built-in ``torch.nn`` module's
#: operations depend only on its class, its public configuration (all part of the key), its
#: parameters' and buffers' shapes (fixed by that configuration) and the input's shape and dtype
#: (part of the key), never on the data; the loss function, user code, is traced on every call
_CHAIN_LAYOUTS: dict[tuple, tuple] = {}
_SIMPLE = (int, float, bool, str, type(None))


def _chain_key(chain: list[nn.Module], xs: Tensor) -> tuple | None:
    """The cache key of a plain chain's separability trace, or None (not cacheable: a module that
    is not a built-in ``torch.nn`` class, or public configuration that is not plain data)."""
    parts: list[Any] = [tuple(xs.shape), xs.dtype, xs.device.type]
    for mod in chain:
        cls = type(mod)
        if not cls.__module__.startswith("torch.nn.modules."):
            return None
        conf = []
        for k, v in mod.__dict__.items():
            if k[0] == "_":
                continue
            if isinstance(v, tuple):
                if not all(isinstance(x, _SIMPLE) for x in v):
                    return None
            elif not isinstance(v, _SIMPLE):
                return None
            conf.append((k, v))
        parts.append((cls, tuple(conf)))
    return tuple(parts)


def _refuse_user_forward_hooks(name: str, mod: nn.Module, ours: Any) -> None:
    """Raise :class:`_RuntimeUnsupported` if a forward hook other than the engine's own (``ours``)
    runs on a hooked layer: a user hook registered before the engine's may replace the layer's
    output (``o + o.mean(0)``), and the gradient of the replacement would then be read as the
    layer's ``b`` while the trace marks it ``(0, 1)`` (hostile review, issue 31: accepted before;
    benchmarks/results/hostile_review_loo.md)."""
    if _module_mod._global_forward_hooks or any(h is not ours for h in mod._forward_hooks.values()):
        raise _RuntimeUnsupported(
            f"layer {name!r} ({type(mod).__name__}) has a forward hook that is not the engine's: "
            "it may replace the layer's output (e.g. mix it over the batch), so the layer's "
            "per-example gradient is not proven. Remove the hook (apply its change in the "
            "model's forward instead), or use engine 'vmap'")


def _check_separable(tracer: SeparabilityTracer | None, calls: list[_Call],
                     losses: Tensor) -> None:
    """Raise :class:`_RuntimeUnsupported` unless the traced forward is row separable: the
    per-example losses and every hooked layer's input have layout ``(0, 1)`` or are constant (each
    row a function of its own example; :mod:`dpclip.engine.separable`)."""
    if tracer is None:
        return
    tracer.retire()
    fix = ("; per-example clipping needs every example's loss to depend on that example alone, "
           "with the batch as the first dimension of every layer's input and output. Keep the "
           "model batch-first and free of operations across the batch, or use engine 'vmap', "
           "which evaluates each example on its own")
    if tracer.violation is not None:
        raise _RuntimeUnsupported(f"the forward pass is not per-example separable: "
                                  f"{tracer.violation}{fix}")
    if tracer.mixers:
        fix = f" (first mixing operation: {tracer.mixers[0]})" + fix
    for c in calls:
        lay_a, lay_out = c.layouts
        # only the input: a supported layer runs its standard forward (``_rule_for`` refuses
        # subclasses that override it), which is per sample along dimension 0 of a batch-first
        # input; its output is then marked ``(0, 1)`` (``_Call``)
        for what, lay in (("input", lay_a),):
            if lay is not None and lay != (0, 1):
                how = ("mixes the examples of the batch (it depends on several examples, e.g. "
                       "through x.mean(0), a softmax or roll over the batch dimension, or an "
                       "operation the separability check does not know)") if lay == "mixed" \
                    else (f"has the batch in dimension {lay[0]}, not 0 (a sequence-first "
                          "layout: a shape coincidence such as T == B cannot hide it)") \
                    if lay[0] != 0 else (f"has each example in {lay[1]} consecutive rows of "
                                         "dimension 0 (the batch flattened with another "
                                         "dimension, e.g. x.view(-1, d)), not one row")
                raise _RuntimeUnsupported(
                    f"the {what} of layer {c.owner.name!r} ({type(c.mod).__name__}) {how}{fix}")
    lay = tracer.layout(losses)
    if lay is not None and lay != (0, 1):
        raise _RuntimeUnsupported(
            "the per-example losses are not per-example separable (layout "
            f"{lay!r}: a loss row depends on other examples, e.g. a batch-centred model or a "
            f"loss normalised over the batch){fix}")


@dataclass(frozen=True)
class AutoEngine:
    """``engine="auto"``: the ghost engine (modules without a rule on its per-layer path, named in
    ``engine_info["per_layer"]``), or the vmap engine where the ghost engine refuses the model;
    ``EngineResult.engine_info`` records which one ran and why.

    It is :class:`GhostEngine` with ``fallback="vmap"``: models that are supported by their layer
    types but fail a run-time check (a parameter used outside its layer, an in-place change of a
    hooked layer's input after the layer used it, a layer applied without the batch dimension first) also run on ``vmap``,
    recorded. Options as :class:`GhostEngine`.
    """

    name: ClassVar[str] = "auto"
    per_example: ClassVar[bool] = True

    max_physical_batch: int | None = None
    norm_mode: str = "mixed"

    def __post_init__(self) -> None:
        if self.max_physical_batch is not None:
            check_chunk_size(self.max_physical_batch, "AutoEngine")
        if self.norm_mode not in NORM_MODES:
            raise ValueError(f"AutoEngine: norm_mode must be one of {NORM_MODES}, got "
                             f"{self.norm_mode!r}")

    def compute(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: Any,
        targets: Any,
        weight_fn: WeightFn | None,
        groups: ParamGroups,
    ) -> EngineResult:
        engine = _AutoGhost(self.max_physical_batch, self.norm_mode, "vmap")
        return engine.compute(model, loss_fn, inputs, targets, weight_fn, groups)


@dataclass(frozen=True)
class _AutoGhost(GhostEngine):
    name: ClassVar[str] = "auto"
