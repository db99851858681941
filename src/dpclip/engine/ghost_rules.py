"""The ghost engine's rules, one per layer type (the seams of :mod:`dpclip.engine.ghost`).

A rule knows, for one recorded call of its layer (:class:`_Call`: the input activations and the
output gradient), how to compute each example's squared gradient norm without forming the
per-example gradient (Gram / ghost inner products, book-keeping blocks), how to form it where
that is cheaper (``_FORM_RATIO``), how to add the clipped weighted sum, and the rounding bound of
its norm (``bound_sq``: a norm that sets a clipping weight upper-bounds the norm of the vector
actually summed, rounding included). Supported layers: ``SUPPORTED_LAYERS`` in
:mod:`dpclip.engine.ghost`; docs/engines.md lists them with their tests.
"""

from __future__ import annotations
import collections
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from dpclip._ident import ident
from dpclip.engine._common import HALF, _Rounding
from dpclip.engine.per_layer import (
    PerLayerUnsupported,
    embedding_class_defines,
    arg_batch_dims,
    capture_args,
    embedding_lookup,
    scale_holds,
    settle_call,
    elementwise_scale,
    join_layouts,
    output_tensors,
    own_param,
    seq_now,
)
from dpclip.engine.separable import MIXED, SeparabilityTracer, uniform_along

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
                 "live_idx", "fast", "oedges", "a_print", "group", "call", "batch_first",
                 "batch_dim", "source")

    def __init__(self, owner: "_Owner", a: Tensor, out: Tensor,
                 tracer: SeparabilityTracer | None = None) -> None:
        #: a batch-less call expanded by the engine (dpclip.engine.batchless): the autograd node
        #: of the layer's own output, which the engine's expansion alone may lead to (set by the
        #: hook; ghost._chunk checks it)
        self.source = None
        if owner.rule.kind == "module":  # the per-layer path (dpclip.engine.per_layer)
            _init_module_call(self, owner, a, out, tracer)
            return
        #: rows of ``a`` and ``b`` per example: 1, or ``k`` when the input has layout ``(0, k)``
        #: (example ``i`` owns rows ``[i k, (i + 1) k)``: K augmented copies, a batch flattened
        #: with another dimension); set from the layouts (``ghost_forward._check_separable``) and
        #: read by the rules (:func:`_fold_rows`)
        self.group = 1
        #: where ``a`` and ``b`` hold the examples: 0, or 1 for a sequence-first call (a layer
        #: acting on trailing dimensions, on a ``(T, B, ...)`` input: ``nn.Transformer*`` layers'
        #: default ``batch_first=False``), moved to the front before the rules read them
        #: (:func:`_fold_rows`)
        self.batch_dim = 0
        #: the separability layouts of the input and output (``(0, 1)``: batch-first, row
        #: separable; see :mod:`dpclip.engine.separable`), or None when the batch was not traced.
        #: The output is then marked ``(0, 1)`` whatever it was (``(0, k)`` for an input of
        #: layout ``(0, k)``): its row ``i`` (block ``i``) carries example ``i``'s share of the
        #: parameter gradient, so the trace must also prove that row ``i`` reaches no other
        #: example's loss (a data-independent output, e.g. of a position embedding, flipped over
        #: the batch would otherwise pass as a constant)
        if tracer is None:
            self.layouts = None
        else:
            lay_a = tracer.layout(a)
            # (REWRITTEN: an in-place write the trace saw made the output mix the examples after
            # the layer computed it: refused by ghost_forward._check_separable)
            self.layouts = (lay_a, REWRITTEN if tracer.rewritten_to_mix(out)
                            else tracer.layout(out))
            k = _row_group(lay_a)
            if _sequence_first(owner, a, out, lay_a, self.layouts[1]):
                # (a layer on trailing dimensions, the examples in dimension 1 of its input and
                # output alike: the output's column i is example i's; checked like any output)
                self.batch_dim, self.group = 1, lay_a[1]
                tracer.mark(out, lay_a)
            else:
                tracer.mark(out, (0, k) if k > 1 and isinstance(out, Tensor) and out.ndim
                            and isinstance(a, Tensor) and a.ndim and out.shape[0] == a.shape[0]
                            else (0, 1))
        self.owner = owner
        self.mod = owner.module
        self.rule = owner.rule
        self.a = a
        self.a_version = a._version
        #: ``[(tensor, fingerprint)]`` of what the engine reads after the forward when user code
        #: runs after the call (a traced step), checked before it is read
        #: (:mod:`dpclip.engine.saved_check`; ``ghost_forward._printed``)
        self.a_print: list | None = None
        self.out_shape = tuple(out.shape)
        self.edge = _gradient_edge(out) if out.requires_grad else None
        self.b: Tensor | None = None
        self.choice = "ghost"
        self.kept: dict[str, Tensor] = {}
        #: ``(rows, gradients)``: examples whose weight gradient is formed and summed directly,
        #: not by book-keeping (terms that cancel: ``_position_bound_sq``)
        self.formed: tuple[Tensor, Tensor] | None = None
        self.outs: list[Tensor] | None = None


#: the output layout of a call whose output an in-place write made MIXED after the layer computed it
REWRITTEN = "rewritten"


def _row_group(layout: Any) -> int:
    """``k`` for an input layout ``(0, k)`` (``k`` rows per example in dimension 0), else 1."""
    if isinstance(layout, tuple) and len(layout) == 2 and layout[0] == 0 and layout[1] >= 1:
        return int(layout[1])
    return 1


def _sequence_first(owner: Any, a: Any, out: Any, lay_a: Any, lay_out: Any) -> bool:
    """Whether a ruled call holds the examples in dimension 1 of its input and output alike
    (layout ``(1, k)``) and its rule acts on trailing dimensions only (``seq_first``: a Linear or
    Conv1D on the last, an Embedding per index, a LayerNorm / RMSNorm over trailing dimensions
    that leave dimension 1 out), so that example ``i``'s rows are column ``i`` of ``a`` and of
    the output gradient (moved to the front by :func:`_fold_rows`). Decided on the trace's layout
    (example data), never on sizes: a ``(T, B, ...)`` input with T == B reads the same."""
    if not (getattr(owner.rule, "seq_first", False) and isinstance(lay_a, tuple)
            and lay_a[0] == 1 and lay_out == lay_a and isinstance(a, Tensor)
            and isinstance(out, Tensor) and a.ndim >= 2 and out.ndim >= 2
            and out.shape[1] == a.shape[1]):
        return False  # (the trace's own layout of the output must be the input's: defence in
        # depth, fifty-ninth hostile review)
    if isinstance(owner.rule, _TrailingNormRule):
        return a.ndim - len(owner.module.normalized_shape) > 1
    if owner.rule.kind == "matmul":  # (dimension 1 must not be the one the product sums)
        return a.ndim >= 3
    return True


def _fold_rows(c: _Call) -> None:
    """``(B k, ...) -> (B, k, ...)`` for ``c.a`` and ``c.b`` of a call with ``k = c.group > 1``
    rows per example: the rows of one example become one more leading position dimension, so
    that every rule reads example ``i`` from index ``i`` of dimension 0 (its gradient is the sum
    over its ``k`` rows, exactly as over the positions of a sequence). A sequence-first call
    (``c.batch_dim`` 1) has its examples' dimension moved to the front first."""
    if getattr(c, "batch_dim", 0) == 1:
        c.a = c.a.movedim(1, 0)
        c.b = c.b.movedim(1, 0)
        c.batch_dim = 0  # (once)
    k = c.group
    if k > 1:
        c.a = c.a.reshape(c.a.shape[0] // k, k, *c.a.shape[1:])
        c.b = c.b.reshape(c.b.shape[0] // k, k, *c.b.shape[1:])


def _init_module_call(c: _Call, owner: "_Owner", a: Any, out: Any,
                      tracer: SeparabilityTracer | None) -> None:
    """A call of a module on the per-layer path (no rule for its type,
    :mod:`dpclip.engine.per_layer`): its output tensors and their gradient edges (the backward's
    inputs for their ``b``), its arguments (from the pre-hook, ``_Owner.enter``) and the autograd
    sequence-number window of the call are kept until the module's per-example gradients are
    formed. Separability: the outputs must be proved row
    separable by the trace (the module's own operations are traced like any other); they are then
    marked ``(0, 1)`` like a layer's output, or ``(0, k)`` when they hold each example in ``k``
    rows (``c.group``; the arguments must then be constants or of layout ``(0, k)``, and the
    module is re-evaluated on each example's ``k`` rows: :func:`~dpclip.engine.per_layer.
    module_grads`)."""
    all_outs = output_tensors(out)
    c.live_idx = [k for k, t in enumerate(all_outs) if t.requires_grad]
    outs = [all_outs[k] for k in c.live_idx]
    start, c.args, c.call = owner.starts.pop() if owner.starts else (None, None, None)
    if c.call is not None:  # the call's proved operations: what the per-layer path replays
        tracer.match.close_call(c.call, outs)
        dead = _dead_outputs(c.call, tracer.match)
        if dead:
            keep = [j for j in range(len(outs)) if j not in dead]
            c.live_idx = [c.live_idx[j] for j in keep]
            outs = [outs[j] for j in keep]
            c.call.out_names = [c.call.out_names[j] for j in keep]
    c.owner, c.mod, c.rule = owner, owner.module, owner.rule
    c.a = a if isinstance(a, Tensor) else None
    c.a_version = c.a._version if c.a is not None else 0
    c.a_print = None
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
    c.window = (start, seq_now())
    # an RMSNorm-like elementwise scale, recognised from the call's graph: no recomputation
    c.fast = None
    # rows per example: k for outputs of layout (0, k)
    assert tracer is not None  # (a per-layer call is always traced: ghost_forward._plain_chain)
    lays = [tracer.layout(t) for t in outs]
    lay = join_layouts(lays)
    if lay is MIXED or (isinstance(lay, tuple) and lay[0] == 1):
        lay = _join_dims(lays)
    if len(owner.roles) == 1 and len(outs) == 1 and len(all_outs) == 1 and start is not None:
        got = elementwise_scale(outs[0], own_param(owner.module, owner.roles[0]), c.window)
        if got is not None and scale_holds(got, c.call):
            c.fast = (got[0], got[1], got[0]._version)
        elif c.args is not None and c.call is not None and c.call.why is None:
            # an embedding lookup of the module's weight (a scaled word embedding): the Embedding
            # rule reads the ids, batch-first example data not written inside the call
            look = embedding_lookup(outs[0], owner.module,
                                    own_param(owner.module, owner.roles[0]),
                                    [t for t, _ in c.args[2]])
            if look is not None and tracer.layout(look.ids) == (0, 1) and \
                    tracer.layout(outs[0]) == (0, 1) and look.ids.ndim >= 1 and \
                    scale_holds((look.ids,), c.call):
                c.fast = look
    k = c.group = _row_group(lay)
    # which captured tensors carry the batch in dimension 0 (sliced per example when the module's
    # per-example gradient is formed): example data by the trace
    c.arg_dims = None if c.args is None else arg_batch_dims(
        c.args[0], c.args[1], tracer.layout, tracer.batch * k, k,
        lambda t: uniform_along(tracer, t, 0, k, tracer.batch),
        # a constant initial state (layers, B, h) of torch's recurrent layers, sliced per
        # example in dimension 1 when the same for everyone; for other modules such a constant
        # stays refused (fourteenth hostile review's zeros(1, B, d) argument)
        (lambda t: uniform_along(tracer, t, 1, k, tracer.batch))
        if isinstance(owner.module, nn.RNNBase) else None)
    if any(isinstance(x, tuple) and x[0] != 0 for x in lays) or \
            (c.arg_dims and any(d in (1, "const1") for d in c.arg_dims)):
        c.fast = None  # (the elementwise scale reads the examples from dimension 0)
    if c.call is not None:  # (closed above)
        settle_call(c.call, tracer.layout, tracer.batch * k)
    if isinstance(owner.module, nn.RNNBase) and all_outs and c.call is not None \
            and c.call.why is None and c.fast is None:
        # torch's recurrent layers: per-example gradients from the time-step structure, no
        # replay (dpclip.engine.recurrent.TimeStepRule; None: the replay)
        from dpclip.engine.recurrent import TimeStepRule

        c.fast = TimeStepRule.recognise(owner.module, owner.roles, all_outs,
                                        tracer.recurrent, tracer.batch * k, c.call.written,
                                        c.window)
    # which outputs hold the examples in their rows: by the proof's shapes where the call was
    # matched (a real first size equal to B * k would make a public (T, d) output batch-first at
    # B * k == T only, a refusal that told the batch size: eighteenth hostile review)
    rows = tracer.batch * k
    names = c.call.out_names if c.call is not None else None
    dims = [x[0] if isinstance(x, tuple) else 0 for x in lays]
    if names is not None and len(names) == len(outs):
        prog = c.call.program
        c.batch_first = [_batch_dim(prog, n, t, rows, d) for n, t, d in zip(names, outs, dims)]
    else:
        c.batch_first = [0 if t.ndim > 0 and t.shape[0] == rows else None for t in outs]
    for t, d in zip(outs, c.batch_first):  # (the others are refused by the engine pass)
        if d is not None:
            tracer.mark(t, (d, k))
    c.layouts = (lay, lay)


def lookup_call(c: _Call) -> _Call:
    """The per-layer call ``c`` recognised as an embedding lookup (:class:`EmbeddingLookup`,
    after the backward: ``c.b`` is the gradient at its output) as a call of the Embedding rule:
    ``a`` the ids, ``b`` the gradient at the lookup (``c.b * s``, as autograd forms it)."""
    look = c.fast
    if not look.unchanged():
        raise PerLayerUnsupported(
            f"the ids (or the scale) of module {c.owner.name!r} ({type(c.mod).__name__}, an "
            "embedding lookup) were modified in place after the call; use out-of-place "
            "operations")
    rule = _RULES[nn.Embedding]
    r = _Call.__new__(_Call)
    r.owner = _Owner(c.owner.name, c.mod, rule, c.owner.roles, c.owner.pnames)
    r.mod, r.rule = c.mod, rule
    r.a = look.ids
    r.b = c.b if look.scale is None else torch.mul(c.b, look.scale)
    r.a_version, r.a_print = look.ids._version, c.a_print
    r.group, r.batch_dim, r.layouts = 1, 0, ((0, 1), (0, 1))
    r.edge, r.out_shape, r.choice, r.kept, r.formed = None, tuple(c.b.shape), "ghost", {}, None
    r.outs = r.bs = r.args = r.arg_dims = r.live_idx = r.fast = r.call = r.batch_first = None
    r.oedges, r.window, r.source = [], c.window, None
    return r


def _dead_outputs(w: Any, match: Any) -> list[int]:
    """The outputs of a matched per-layer call that the proof has no name for, when at least one
    output has a name: dead code in the proof (``nn.MultiheadAttention``'s attention weights when
    only its output is used; ``torch.export`` drops what reaches no loss). The match gives no
    name to an extra operation's output, and an operation that reads an unnamed tensor matches
    nothing (``proved_program``: the run fails, or the operation is itself an unnamed extra), so
    such an output reaches no per-example loss: its gradient is zero, its rows need not be
    separable, and the call's product over its other outputs is the whole gradient (a parameter
    edge reachable from it alone is refused by ``per_layer.check_module_windows``). None when the
    match failed (then nothing is named reliably, and the call is refused)."""
    if match is None or match.mismatch is not None or w.why is not None:
        return []
    dead = [j for j, n in enumerate(w.out_names) if n is None]
    return dead if len(dead) < len(w.out_names) else []


def _join_dims(lays: list[Any]) -> Any:
    """The layout ``(0, k)`` that stands for a per-layer call's outputs when each holds the
    examples in blocks of the same ``k`` but not all in the same dimension: dimension 0 or 1
    (``nn.LSTM``'s ``(output, (h_n, c_n))``: the final states have the batch in dimension 1,
    whatever ``batch_first`` says). Each output is then read per example along its own dimension
    (``c.batch_first``, :func:`~dpclip.engine.per_layer.module_grads`). Else MIXED."""
    ks = {x[1] for x in lays if isinstance(x, tuple)}
    if len(ks) != 1 or any(x is MIXED or (isinstance(x, tuple) and x[0] not in (0, 1))
                           for x in lays):
        return MIXED
    return (0, ks.pop())


def _batch_dim(prog: Any, name: Any, t: Tensor, rows: int, d: int) -> int | None:
    """The dimension (``d``, where the trace put the examples; 0 for a constant) in which a
    per-layer call's output ``t`` (the proof's ``name``) holds the examples in ``rows`` entries,
    or None: the proof's size there involves the batch size, or (``d`` 0) it is 1 and the engine
    expanded the output to the batch (a batch-less call, ``dpclip.engine.batchless``: rows that
    are all the same, stride 0)."""
    if t.ndim <= d or t.shape[d] != rows:
        return None
    if name is None and d:
        # an output the proof's program does not make (dead code there: an RNN's final states
        # that the loss never reads): no matched operation reads it, so its gradient must be
        # None, which module_grads checks before it leaves it out of the replay
        return d
    if name is None or name[0] != "op":
        return None
    if prog.symbolic_at(name, d):
        return d
    if d:
        return None
    shape = prog.shape(name, 2)
    ok = shape is not None and len(shape) == t.ndim and shape[0] == 1 and t.stride(0) == 0
    return 0 if ok else None


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
    """``sum`` over the book-keeping blocks of ``part(slice)`` (see ``_BK_BLOCK``), the blocks'
    sums added in float64 and cast once (a float32 accumulator rounds each addition on the grid
    of the running total, and removing one example shifts every later block's composition:
    the hundred-and-fortieth hostile review's attack on the chunks' accumulator, here per block
    of 64 examples)."""
    out = None
    blocks = _bk_blocks(batch)
    for sl in blocks:
        r = part(sl)
        if out is None:
            out = r if len(blocks) == 1 or r.dtype != torch.float32 else r.double()
        else:
            out.add_(r)
    if out is not None and len(blocks) > 1 and out.dtype == torch.float64 and \
            r.dtype == torch.float32:
        out = out.float()
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
    """``sum_i w_i g_i`` for per-example tensors ``g`` of shape ``(B, *shape)``, in float64 for
    float32 and narrower ``g`` (the weights as the engine computed them: float32 for half
    layers, _common.HALF; their products exact in float64, the sum over the examples rounding at
    float64's unit: a float32 ``w @ g`` sums the examples one after another in MKL, and a designed
    batch steered its rounding by one example's presence, 1.22 C at one chunk of 4096;
    hundred-and-forty-first hostile review). Float64 ``g`` as it is."""
    flat = g.reshape(g.shape[0], -1)
    if g.dtype == torch.float64:
        return (w.to(g.dtype) @ flat).view(g.shape[1:])
    w = w.float() if g.dtype in HALF else w.to(g.dtype)
    return (w.double() @ flat.double()).view(g.shape[1:])


def widen64(t: Any) -> Any:
    """A float32 / float16 / bfloat16 tensor in float64 (exact); anything else as it is."""
    if isinstance(t, Tensor) and t.dtype in (torch.float32, *HALF):
        return t.double()
    return t


def _sq(g: Tensor) -> Tensor:
    """Squared norms of the rows of ``g`` (one fused reduction, no temporary of ``g``'s size);
    float16 and bfloat16 rows in float32 (their squares would overflow or underflow: the absolute
    underflow term of the engine assumes float32's range, ghost._underflow_floor)."""
    flat = g.reshape(g.shape[0], -1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32).square()
    return torch.linalg.vector_norm(flat, dim=1).square()


class _Rule:
    """How to get per-example norms and weighted sums of one layer type from ``a`` and ``b``."""

    roles: ClassVar[tuple[str, ...]] = ("weight", "bias")
    #: "matmul": a ghost/direct/keep choice by :meth:`dims`; "embedding": Gram or segment sums;
    #: "affine": the (small) per-example gradients are always formed and kept
    kind: ClassVar[str] = "affine"
    #: acts on trailing dimensions only: may read a sequence-first call (:func:`_sequence_first`)
    seq_first: ClassVar[bool] = False

    def unsupported(self, mod: nn.Module) -> str | None:
        """A reason this configuration of the layer is not supported, or None."""
        return None

    def prepare(self, c: _Call) -> None:
        """Normalise ``c.a`` / ``c.b`` (flatten, pad) once ``c.b`` is known; the rows of one
        example (``c.group > 1``) are folded into dimension 1 (:func:`_fold_rows`)."""
        _fold_rows(c)

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
        return sum(own_param(c.mod, r).numel() for r in roles) + 4

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


def _linear_gram_error(na: Tensor, nb: Tensor, dtype: torch.dtype, d: int, p: int, t: int,
                       rnd: _Rounding) -> tuple[Tensor, float]:
    """The two terms of a Linear call's Gram-norm rounding bound (:meth:`_LinearRule.bound_sq`
    and the grouped reduction, :func:`linear_ghost_parts`, share them): ``abs_sum`` (per row,
    ``sum_t ||a_t|| ||b_t||`` rounded up, the scale the error is relative to) and ``gram`` (the
    relative error of the two float-``dtype`` Gram matrices of ``d``- and ``p``-wide rows and
    their float64 inner product of ``t * t`` terms). ``na``, ``nb``: the rows' norms, ``(rows, t)``."""
    abs_sum = _vecdot(na, nb).to(dtype) * (1 + rnd.gam(max(d, p) + t + 4))
    gram = rnd.gp(d) + rnd.gp(p) + rnd.gp(d) * rnd.gp(p) \
        + _gam64(t * t + 1) * (1 + rnd.gp(d)) * (1 + rnd.gp(p))
    return abs_sum, gram


def _dot64(x: Tensor, y: Tensor) -> Tensor:
    """Per row, the inner product of two ``(rows, k)`` tensors in float64 (a float64 tensor on
    their device): the rows cast to float64 (exact for float32 and narrower), then products and
    sum in float64. On the CPU, for float32 rows, numpy's ``vecdot`` (numpy >= 2): with the cast
    ~4x faster than torch's portable CPU kernels (:func:`dpclip.blas_mode.kernels`), which dpclip
    runs (the Gram inner products of a transformer step: ~20 % of it). Each row is one dot
    product whatever its position, so its value does not depend on the other rows (``einsum``
    splits a row longer than numpy's buffer where the buffer ends: 20 of 20 rows of 9999 changed
    with their position); the error is that of a float64 sum of ``k`` terms in any order
    (``_gam64(k)``). numpy's functions are the ones bound when dpclip was imported (a forward
    that replaced ``numpy.einsum`` scaled one example's Gram rows by 0.02: LOO 3.18 C,
    eighty-fifth hostile review)."""
    if _NP_VECDOT is not None and x.device.type == "cpu" and x.dtype == torch.float32 \
            and y.dtype == torch.float32:
        xn, yn = x.detach().numpy(), y.detach().numpy()
        rows, k = xn.shape
        step = max(1, _DOT_BLOCK_NUMEL // max(k, 1))
        if step >= rows:
            return _from_numpy(_NP_VECDOT(xn.astype(_NP_F64), yn.astype(_NP_F64)))
        # block by block through two float64 buffers that stay in cache (the whole float64 copies
        # of a transformer's Gram matrices were 67 MB each, mapped afresh every step): each row
        # is still one vecdot of the same float64 row, so the same value
        out = _NP_EMPTY(rows, dtype=_NP_F64)
        sx = _NP_EMPTY((step, k), dtype=_NP_F64)
        sy = _NP_EMPTY((step, k), dtype=_NP_F64)
        for i in range(0, rows, step):
            j = min(i + step, rows)
            _NP_COPYTO(sx[:j - i], xn[i:j])
            _NP_COPYTO(sy[:j - i], yn[i:j])
            _NP_VECDOT(sx[:j - i], sy[:j - i], out=out[i:j])
        return _from_numpy(out)
    return _vecdot(x.double(), y.double())


#: numpy's and torch's functions that the CPU passes call, bound at import (what a forward or a
#: loss rebinds in numpy's namespace later does not reach the engine; ufuncs are C objects)
_NP_VECDOT = getattr(np, "vecdot", None)
_NP_MUL = np.multiply
_NP_ABS = np.absolute
_NP_GREATER = np.greater
_NP_F64 = np.dtype("float64")
#: torch's C functions the reductions call, bound at import (their Python wrappers in
#: torch.nn.functional and torch.ops look up names and descriptors a forward could replace, run
#: inside the reduction: F.layer_norm / F.group_norm / F.batch_norm read
#: torch.backends.cudnn.enabled through a Python getter, 10.4-11.3 C; torch.ops.aten's packet
#: calls its instance attribute _op, 26.6 C; ninety-second and ninety-third hostile reviews).
#: The cudnn flag F.* would pass only picks a CUDA kernel for these operations.
_LAYER_NORM = torch.layer_norm
_GROUP_NORM = torch.group_norm
_BATCH_NORM = torch.batch_norm
_RMS_NORM = torch.rms_norm
_PAD = torch._C._nn.pad
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default._op
_NP_EMPTY = np.empty
_NP_BOOL = np.dtype("bool")
_NP_COPYTO = np.copyto
#: float64 elements per buffer of :func:`_dot64`'s blocks (2 MiB)
_DOT_BLOCK_NUMEL = 1 << 18
_from_numpy = torch.from_numpy


def _scaled(x: Tensor, w: Tensor) -> Tensor:
    """``x * w`` (broadcast; a new tensor): the rows of a layer's ``a`` or ``b`` scaled by the
    clipping weights before the book-keeping products. On the CPU, for float32 / float64 operands
    of one dtype, by numpy (~4x torch's portable CPU kernels, :mod:`dpclip.blas_mode`): a product
    is correctly rounded in both, so the values are the same bits."""
    if x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == w.dtype and \
            x.dtype in (torch.float32, torch.float64):
        return _from_numpy(_NP_MUL(x.detach().numpy(), w.detach().numpy()))
    return x * w


def _gram_dot(ga: Tensor, gb: Tensor, groups: int = 1) -> Tensor:
    """``sum_k ga[i, k] gb[i, k]`` per row (summed further over ``groups`` consecutive rows), in
    float64, then rounded UP to the working dtype.

    Products of float32 (or float16/bfloat16) numbers are exact in float64, so the only error is
    that of the float64 sum, ``_gam64(n)`` relative to ``sum |ga gb|``, instead of float32's
    ``gam(n)``: for a sequence of T positions the sum has T^2 terms, and float32's bound
    (T^2 * 6e-8) would make the error term of the ghost norm dominate (and force per-example
    gradients to be formed) for T of a few dozen. Rounding up keeps the value an upper bound of
    the float64 result."""
    exact = _dot64(ga.flatten(1), gb.flatten(1))
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
    seq_first = True

    def rel_len(self, c: _Call, roles: Sequence[str]) -> int:
        if c.a.ndim == 2:  # ||a||^2 ||b||^2 (+ ||b||^2): two row dot products, one product
            return c.a.shape[1] + c.b.shape[1] + 4
        return super().rel_len(c, roles)

    def bound_sq(self, c: _Call, sq: Tensor, rnd: _Rounding) -> Tensor | None:
        if c.a.ndim == 2 or c.choice == "keep":
            return None
        a, b = c.a, c.b
        t, d, p = a.shape[1], a.shape[2], b.shape[2]
        na = torch.linalg.vector_norm(a, dim=2)
        nb = torch.linalg.vector_norm(b, dim=2)
        abs_sum, gram = _linear_gram_error(na, nb, sq.dtype, d, p, t, rnd)
        return _position_bound_sq(
            sq, abs_sum, c.choice, d * p, t, gram, _BK_BLOCK * t, rnd,
            lambda rows: _sq(torch.bmm(b[rows].transpose(1, 2), a[rows])),
            lambda rows: _store_formed(c, rows, torch.bmm(b[rows].transpose(1, 2), a[rows])))

    def prepare(self, c: _Call) -> None:
        _fold_rows(c)  # k rows per example: k more positions, (B, k, ..., d)
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
                    out["weight"] = torch.mm(b.t(), _scaled(a, w.col2(g_w)))
                else:
                    bw = _scaled(b, w.col2(g_w))
                    out["weight"] = torch.mm(bw.t(), a)
                    if g_b == g_w:
                        out["bias"] = bw.sum(0)
                        return out
            if g_b is not None:
                out["bias"] = w.col(g_b) @ b
            return out
        if g_w is not None:  # (w*b)^T a over the (example, position) rows of each block
            wb, formed = _split_formed(c, w.col(g_w))
            bw = _scaled(b, wb.view(-1, 1, 1))
            out["weight"] = _bk_sum(b.shape[0], lambda sl: torch.mm(
                bw[sl].reshape(-1, b.shape[-1]).t(), a[sl].reshape(-1, a.shape[-1])))
            if formed is not None:
                out["weight"].add_(formed)
        if g_b is not None:
            out["bias"] = w.col(g_b) @ b.sum(1)
        return out


#: the Gram matrices of the calls read together by :func:`linear_ghost_parts` take at most this
#: many floats (both Gram matrices of every call of one group); a call whose own take more is read
#: alone, in slices of examples (``_LinearRule.norms``)
_GROUP_TEMP_MAX_NUMEL = 1 << 23


def linear_ghost_key(c: _Call, single: bool) -> tuple | None:
    """The key under which :func:`linear_ghost_parts` reads ``c`` together with calls of equal
    shapes, or None: ``c`` must be a Linear (or ``transformers`` Conv1D) call on positions
    (``a`` of shape ``(B, T, d)`` once prepared) with the ghost choice, a weight role, parameters
    used by this call alone (``single``), and both Gram matrices of all its examples within
    half of ``_GROUP_TEMP_MAX_NUMEL``."""
    if not single or type(c.rule) not in (_LinearRule, _Conv1DRule) or c.choice != "ghost":
        return None
    a, b = c.a, c.b
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.ndim != 3 or b.ndim != 3:
        return None
    roles = c.owner.roles
    if "weight" not in roles or 2 * a.shape[0] * 2 * a.shape[1] ** 2 > _GROUP_TEMP_MAX_NUMEL:
        return None
    return (tuple(a.shape), tuple(b.shape), a.dtype, b.dtype, a.device, tuple(roles))


def linear_ghost_parts(calls: Sequence[_Call], rnd: _Rounding) -> tuple[Tensor, Tensor | None]:
    """``(W, Bias)``: the squared weight bounds ``(L, B)`` and squared bias norms ``(L, B)`` (None
    without a bias role) of ``L`` calls with one :func:`linear_ghost_key`, exactly what
    ``_LinearRule.norms`` and ``_LinearRule.bound_sq`` give each call (the same operations on the
    same values, the elementwise ones made once for the group: a BERT or GPT-2 step reads dozens of
    equal-shaped projections, and each operation is a launch on a GPU). A Gram matrix of an input
    read by several calls (the query, key and value projections of one attention) is formed once.
    Sets ``c.kept["bias"]`` and, through ``_position_bound_sq``, ``c.formed`` of each call."""
    first = calls[0]
    batch, t, d = first.a.shape
    p = first.b.shape[2]
    dt = first.a.dtype
    with_bias = "bias" in first.owner.roles
    # the calls in groups whose Gram matrices fit the budget
    per_call = 2 * batch * t * t
    size = max(1, _GROUP_TEMP_MAX_NUMEL // per_call)
    w_parts, b_parts = [], []
    for lo in range(0, len(calls), size):
        part = calls[lo:lo + size]
        w, bias = _linear_ghost_block(part, rnd, batch, t, d, p, dt, with_bias)
        w_parts.append(w)
        if bias is not None:
            b_parts.append(bias)
    w = w_parts[0] if len(w_parts) == 1 else torch.cat(w_parts)
    bias = None
    if with_bias:
        bias = b_parts[0] if len(b_parts) == 1 else torch.cat(b_parts)
    return w, bias


def _linear_ghost_block(calls: Sequence[_Call], rnd: _Rounding, batch: int, t: int, d: int,
                        p: int, dt: torch.dtype, with_bias: bool) -> tuple[Tensor, Tensor | None]:
    n = len(calls)
    dev = calls[0].a.device
    # one Gram matrix (and one row-norm vector) per distinct input: equal storage, offset, shape
    # and strides are the same values (nothing writes them while the reduction reads them)
    slot: dict[tuple, int] = {}
    inputs: list[Tensor] = []
    idx = []
    for c in calls:
        a = c.a
        k = (a.data_ptr(), tuple(a.stride()))
        j = slot.get(k)
        if j is None:
            j = slot[k] = len(inputs)
            inputs.append(a)
        idx.append(j)
    ga = torch.empty((len(inputs), batch, t, t), dtype=dt, device=dev)
    na = torch.empty((len(inputs), batch, t), dtype=dt, device=dev)
    for j, a in enumerate(inputs):
        torch.bmm(a, a.transpose(1, 2), out=ga[j])
        torch.linalg.vector_norm(a, dim=2, out=na[j])
    gb = torch.empty((n, batch, t, t), dtype=calls[0].b.dtype, device=dev)
    nb = torch.empty((n, batch, t), dtype=calls[0].b.dtype, device=dev)
    sums = torch.empty((n, batch, p), dtype=calls[0].b.dtype, device=dev) if with_bias else None
    for i, c in enumerate(calls):
        b = c.b
        torch.bmm(b, b.transpose(1, 2), out=gb[i])
        torch.linalg.vector_norm(b, dim=2, out=nb[i])
        if sums is not None:
            torch.sum(b, 1, out=sums[i])
            c.kept["bias"] = sums[i]
    if idx != list(range(n)):
        # (each call's rows against its input's Gram matrix, which is not copied per call: the
        # same row values, so the same sums)
        sq = torch.cat([_gram_dot(ga[j], gb[i]) for i, j in enumerate(idx)])
        na = na.index_select(0, torch.tensor(idx, device=dev))
    else:
        sq = _gram_dot(ga.view(n * batch, t, t), gb.view(n * batch, t, t))
    # _LinearRule.bound_sq for every (call, example) row at once
    abs_sum, gram = _linear_gram_error(na.view(n * batch, t), nb.view(n * batch, t), sq.dtype,
                                       d, p, t, rnd)

    def per_call(rows: Tensor, each: Any) -> list[tuple[int, Tensor]]:
        """``rows`` (of the ``n * batch`` rows, ascending) split by call: ``[(call, examples)]``."""
        out = []
        for i in torch.unique_consecutive(torch.div(rows, batch, rounding_mode="floor")).tolist():
            mine = rows[(rows >= i * batch) & (rows < (i + 1) * batch)] - i * batch
            out.append((i, each(calls[i], mine)))
        return out

    def direct(rows: Tensor) -> Tensor:
        got = per_call(rows, lambda c, r: _sq(torch.bmm(c.b[r].transpose(1, 2), c.a[r])))
        return torch.cat([s for _, s in got])

    def form(rows: Tensor) -> tuple[Tensor, Tensor]:
        got = per_call(rows, lambda c, r: _store_formed(
            c, r, torch.bmm(c.b[r].transpose(1, 2), c.a[r])))
        return (torch.cat([kept + i * batch for i, (kept, _) in got]),
                torch.cat([s for _, (_, s) in got]))

    bound = _position_bound_sq(sq, abs_sum, "ghost", d * p, t, gram, _BK_BLOCK * t, rnd,
                               direct, form)
    bias = None
    if sums is not None:
        bias = _sq(sums.view(n * batch, p)).view(n, batch)
    return bound.view(n, batch), bias


_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _built_padding(mod: nn.Module) -> tuple[int, ...] | None:
    """The ``_reversed_padding_repeated_twice`` that ``torch.nn`` convolutions build from their
    ``padding`` (ints, or ``"valid"`` / ``"same"``), ``kernel_size`` and ``dilation``; None for
    values the constructor would refuse."""
    k, d, pad = mod.kernel_size, mod.dilation, mod.padding
    if type(k) is not tuple or type(d) is not tuple or len(d) != len(k) or \
            not all(type(v) is int and v > 0 for v in k + d):
        return None
    if isinstance(pad, str):
        if pad == "valid":
            return (0,) * (2 * len(k))
        if pad != "same":
            return None
        got = []
        for di, ki in zip(reversed(d), reversed(k)):
            total = di * (ki - 1)
            got += [total // 2, total - total // 2]
        return tuple(got)
    if type(pad) is not tuple or len(pad) != len(k) or \
            not all(type(v) is int and v >= 0 for v in pad):
        return None
    return tuple(v for v in reversed(pad) for _ in range(2))


class _ConvRule(_Rule):
    """Conv1d / Conv2d. When the layer pads by itself (a padding mode other than zeros, or string
    padding), :meth:`prepare` pads ``c.a`` the same way and the formulas use padding 0.

    With ``k = c.group > 1`` rows per example, ``c.a`` / ``c.b`` are ``(B, k, C, *spatial)`` after
    :meth:`prepare` (:func:`_fold_rows`): the ``k`` rows' output positions are the example's
    positions (``k L`` of them, ordered row-major), in the patch and output-gradient matrices,
    the Gram matrices and the rounding bounds; the convolutions themselves run on the rows."""

    kind = "matmul"

    def unsupported(self, mod: nn.Module) -> str | None:
        """The padding the forward applies must be what the class builds from ``padding``,
        ``kernel_size`` and ``dilation``, on the spatial dimensions only (nineteenth hostile
        review: ``padding_mode = "constant"`` and ``_reversed_padding_repeated_twice = (1, 1, 0,
        0, 1, -1)`` set after construction made the layer's own ``F.pad`` shift the batch by one
        row, and this rule pads the same way: LOO 2.20 C under ghost and auto)."""
        if mod.padding_mode not in _PADDING_MODES:
            return (f"padding_mode={mod.padding_mode!r} is not one of torch's "
                    f"({', '.join(_PADDING_MODES)}); build the layer with a supported mode")
        want = _built_padding(mod)
        got = getattr(mod, "_reversed_padding_repeated_twice", None)
        if want is None or type(got) not in (list, tuple) or tuple(got) != want:
            return ("its padding list (_reversed_padding_repeated_twice) is not the one its "
                    "padding, kernel_size and dilation give (changed after construction); "
                    "build the layer with the padding it should apply")
        return None

    @staticmethod
    def _padding(c: _Call) -> tuple[int, ...]:
        mod = c.mod
        if isinstance(mod.padding, str) or mod.padding_mode != "zeros":
            return (0,) * len(mod.kernel_size)
        return tuple(mod.padding)

    @staticmethod
    def _flat(c: _Call, t: Tensor) -> Tensor:
        """The rows of ``t`` (examples, or a slice of them): ``(n k, C, *spatial)``."""
        return t.flatten(0, 1) if c.group > 1 else t

    @staticmethod
    def _positions(c: _Call) -> int:
        """Output positions of one example: ``k`` rows times the output's spatial size."""
        return c.group * math.prod(c.b.shape[c.b.ndim - len(c.mod.kernel_size):])

    @staticmethod
    def _by_example(c: _Call, t: Tensor, n: int) -> Tensor:
        """``(n k, g, ..., L) -> (n, g, ..., k L)``: per-row, per-group position vectors (the last
        dimension) joined per example (identity for ``k = 1``)."""
        k = c.group
        if k == 1:
            return t
        t = t.reshape(n, k, *t.shape[1:])
        return t.movedim(1, -2).reshape(n, *t.shape[2:-1], k * t.shape[-1])

    def _grad_rows(self, c: _Call, b: Tensor) -> Tensor:
        """The output gradients of examples ``b`` as ``(n g, C_out/g, k L)`` matrices (same position
        order as :meth:`_unfold`)."""
        n, g = b.shape[0], c.mod.groups
        rows = self._flat(c, b)
        bb = rows.reshape(rows.shape[0], g, rows.shape[1] // g, -1)
        return self._by_example(c, bb, n).reshape(n * g, bb.shape[2], -1)

    def _bias_grads(self, c: _Call, b: Tensor) -> Tensor:
        """Per-example bias gradients ``(B, C_out)``: the output gradient summed over positions."""
        return b.flatten(3).sum((1, 3)) if c.group > 1 else b.flatten(2).sum(2)

    def prepare(self, c: _Call) -> None:
        mod = c.mod
        if isinstance(mod.padding, str) or mod.padding_mode != "zeros":
            mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
            c.a = _PAD(c.a, mod._reversed_padding_repeated_twice, mode)
        _fold_rows(c)  # (on the rows: F.pad's modes take the layer's own rank)

    def dims(self, c: _Call) -> tuple[int, int, int, int]:
        mod = c.mod
        positions = self._positions(c)
        return positions, mod.in_channels * math.prod(mod.kernel_size), mod.out_channels, mod.groups

    def _unfold(self, c: _Call, a: Tensor) -> tuple[Tensor, bool]:
        """``(patches, channels_last)``: ``patches`` of shape ``(B * groups, L, fan_in)``, one row
        per output position (``k L`` of them with ``k`` rows per example: :meth:`_by_example`),
        ``fan_in = C_in/groups * K`` ordered ``(C, *kernel)`` or, when
        ``channels_last`` (groups == 1), ``(*kernel, C)``.

        Built as a strided view of the (padded) input and copied once by ``reshape`` (``F.unfold``,
        im2col, is one to two orders of magnitude slower on CPU); with one group the input is made
        channels-last first, so that the copy moves runs of ``C`` contiguous values. ``a`` is
        ``c.a`` or a slice of its examples."""
        mod = c.mod
        n = a.shape[0]
        a = self._flat(c, a)
        pad = self._padding(c)
        if any(pad):
            a = _PAD(a, [q for p in reversed(pad) for q in (p, p)])
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
        if channels_last:  # (B, *out, *kernel, C); the k rows of an example are consecutive
            view = a.as_strided([batch] + o_size + k_size + [channels],
                                [a.stride(0)] + o_stride + k_stride + [a.stride(-1)],
                                a.storage_offset())
            return view.reshape(n, batch // n * positions, fan_in), True
        # (B, g, C/g, *kernel, *out) -> (B * g, L, fan_in)
        view = a.as_strided([batch, g, channels // g] + k_size + o_size,
                            [a.stride(0), a.stride(1) * (channels // g), a.stride(1)] + k_stride
                            + o_stride, a.storage_offset())
        u = self._by_example(c, view.reshape(batch, g, fan_in, positions), n)
        return u.reshape(n * g, fan_in, -1).transpose(1, 2), False

    def _weight_grad(self, c: _Call, inp: Tensor, grad_out: Tensor, shape: Sequence[int],
                     groups: int) -> Tensor:
        mod = c.mod
        dummy = grad_out.new_empty(1).expand(*shape)
        return _CONV_BACKWARD(
            grad_out, inp, dummy, None, mod.stride, self._padding(c), mod.dilation, False,
            [0] * (inp.ndim - 2), groups, [False, True, False])[1]

    def _patch_numel(self, c: _Call) -> int:
        """Floats of one example's patch matrix (fan-in x positions)."""
        mod = c.mod
        return mod.in_channels * math.prod(mod.kernel_size) * self._positions(c)

    def _per_example_weight(self, c: _Call, a: Tensor | None = None,
                            b: Tensor | None = None) -> Tensor:
        """Per-example weight gradients of ``c`` (or of the examples in ``a``, ``b``: slices)."""
        mod = c.mod
        a = c.a if a is None else a
        b = c.b if b is None else b
        batch, g = a.shape[0], mod.groups
        cin_g = mod.in_channels // g
        if cin_g > 1 and cin_g * math.prod(mod.kernel_size) * self._positions(c) \
                <= _PATCH_MAX_NUMEL:
            # small patch matrices: copy them, then one batched matmul per (example, group)
            u, channels_last = self._unfold(c, a)
            gw = torch.bmm(self._grad_rows(c, b), u)
            if channels_last:  # (B, C_out, *kernel, C_in) -> (B, C_out, C_in, *kernel)
                gw = gw.view(batch, mod.out_channels, *mod.kernel_size, cin_g).movedim(-1, 2)
                return gw.contiguous()
        else:  # a grouped convolution weight-gradient with the rows folded into the groups
            a, b = self._flat(c, a), self._flat(c, b)
            rows = a.shape[0]
            x = a.reshape(1, rows * a.shape[1], *a.shape[2:])
            go = b.reshape(1, rows * b.shape[1], *b.shape[2:])
            gw = self._weight_grad(c, x, go, (rows * mod.out_channels, cin_g, *mod.kernel_size),
                                   rows * g)
            if rows != batch:  # the k rows of an example summed
                return gw.view(batch, rows // batch, mod.out_channels, cin_g,
                               *mod.kernel_size).sum(1)
        return gw.view(batch, mod.out_channels, cin_g, *mod.kernel_size)

    def norms(self, c: _Call, roles: Sequence[str]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        batch = c.a.shape[0]
        if "weight" in roles:
            a, b = c.a, c.b
            positions = self._positions(c)
            patches = self._patch_numel(c)
            if c.choice == "ghost":  # Gram matrices of the patches and of the output gradients
                parts = []
                for sl in _example_slices(batch, patches + 2 * positions * positions):
                    u, _ = self._unfold(c, a[sl])
                    ga = torch.bmm(u, u.transpose(1, 2))
                    bb = self._grad_rows(c, b[sl])
                    gb = torch.bmm(bb.transpose(1, 2), bb)
                    n = b[sl].shape[0]
                    parts.append(_gram_dot(ga, gb, ga.shape[0] // n))
                out["weight"] = parts[0] if len(parts) == 1 else torch.cat(parts)
            else:
                numel = c.mod.weight.numel()
                # (k rows per example: the rows' gradients are formed before their sum)
                slices = _example_slices(batch, patches + c.group * numel)
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
            gb = self._bias_grads(c, c.b)
            c.kept["bias"] = gb
            out["bias"] = _sq(gb)
        return out

    def per_example(self, c: _Call, role: str) -> Tensor:
        if role == "bias":
            return self._bias_grads(c, c.b)
        return self._per_example_weight(c)

    def bound_sq(self, c: _Call, sq: Tensor, rnd: _Rounding) -> Tensor | None:
        if c.choice == "keep":
            return None
        mod, a, b = c.mod, c.a, c.b
        fa, fb = self._flat(c, a), self._flat(c, b)  # the rows
        batch, rows, g, nd = a.shape[0], fa.shape[0], mod.groups, fa.ndim - 2
        # ||patch_t||^2 per group: the squares summed over the group's channels, then over each
        # kernel window (a convolution with a kernel of ones, same geometry as the layer)
        a2 = fa.square().reshape(rows, g, fa.shape[1] // g, *fa.shape[2:]).sum(2)
        ones = a2.new_ones((g, 1, *mod.kernel_size))
        conv = F.conv1d if nd == 1 else F.conv2d
        pa2 = conv(a2, ones, None, mod.stride, self._padding(c), mod.dilation, g)
        # (B, g, k L): the positions of an example's k rows
        na = self._by_example(c, pa2.clamp(min=0).sqrt().reshape(rows, g, -1), batch)
        nb = self._by_example(c, torch.linalg.vector_norm(
            fb.reshape(rows, g, fb.shape[1] // g, -1), dim=2), batch)
        positions = na.shape[2]
        fan_in = fa.shape[1] // g * math.prod(mod.kernel_size)
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
            bw = _scaled(b, wc.view(-1, *([1] * (b.ndim - 1))))
            out["weight"] = _bk_sum(b.shape[0], lambda sl: self._weight_grad(
                c, self._flat(c, c.a[sl]), self._flat(c, bw[sl]), c.mod.weight.shape,
                c.mod.groups))
            if formed is not None:
                out["weight"].add_(formed.view(c.mod.weight.shape))
        if "bias" in groups:
            out["bias"] = w.col(groups["bias"]) @ self._bias_grads(c, b)
        return out


class _Sub:
    """The rows ``rows`` of a call's ``a`` and ``b`` (for a rule's ``per_example``)."""

    def __init__(self, c: _Call, rows: Tensor) -> None:
        self.a, self.b, self.mod, self.group = c.a[rows], c.b[rows], c.mod, c.group


class _EmbeddingRule(_Rule):
    roles = ("weight",)
    kind = "embedding"
    seq_first = True

    def unsupported(self, mod: nn.Module) -> str | None:
        why = embedding_class_defines(mod)
        if why is not None:
            return (f"{why}, which the rule reads (the instance's own attributes only); define "
                    "no property or attribute hook over an embedding's configuration")
        if mod.max_norm is not None:
            return ("max_norm is set (the forward renormalises the weight in place); use "
                    "max_norm=None")
        w = mod._parameters.get("weight")
        n = mod.__dict__.get("num_embeddings")
        if type(n) is not int or w is None or w.ndim != 2 or w.shape[0] != n:
            # (the rule keys each (example, token) as example * num_embeddings + token: a
            # smaller count than the table's rows made keys of two examples meet, a crash)
            return (f"num_embeddings ({n!r}) is not the number of rows of the weight "
                    f"({tuple(w.shape) if w is not None else None}); keep them equal")
        if mod.scale_grad_by_freq:
            return "scale_grad_by_freq=True (batch-frequency scaling); use scale_grad_by_freq=False"
        return None

    def prepare(self, c: _Call) -> None:
        _fold_rows(c)  # k rows per example: k times the positions
        batch = c.a.shape[0]
        c.a = c.a.reshape(batch, -1)
        b = c.b.reshape(batch, c.a.shape[1], -1)
        pad = c.mod.padding_idx
        if pad is not None:  # PyTorch gives the padding row no gradient
            if pad < 0:  # (set after construction: F.embedding reads -1 as row V - 1)
                pad += c.mod.num_embeddings
            b = b * (c.a != pad).unsqueeze(2).to(b.dtype)
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
        # (an example whose terms cancel, A > _FORM_RATIO g, is formed: its segment sums are
        # summed directly, not by book-keeping, which rounds relative to w A ~ C / bk: cancelling
        # examples rounded the OTHER examples' rows of the sum, and removing one example moved
        # the rest across those roundings, LOO 1.65 C at B = 4096; hundred-and-thirty-third
        # hostile review)
        return _position_bound_sq(sq, abs_sum, "ghost" if c.choice == "ghost" else "direct",
                                  p + t, t, gram, _BK_BLOCK * t, rnd,
                                  lambda rows: _sq(self.per_example(_Sub(c, rows), "weight")),
                                  lambda rows: self._form(c, rows))

    @staticmethod
    def _form(c: _Call, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The examples ``rows``' gradients formed as their segment sums (one row of the table per
        (example, token) it looks up, not the dense ``(V, p)`` table), kept for the sum
        (``c.formed``: ``(rows, (example of each segment, its token, the segment sums))``);
        returns the finite rows and their squared norms."""
        x, b = c.a[rows], c.b[rows]
        n, vocab, p = x.shape[0], c.mod.num_embeddings, b.shape[2]
        key = torch.arange(n, device=x.device).unsqueeze(1) * vocab + x
        uniq, inv = torch.unique(key.flatten(), return_inverse=True)
        seg = b.new_zeros(uniq.shape[0], p).index_add_(0, inv, b.reshape(-1, p))
        ex = uniq // vocab
        sq = b.new_zeros(n).index_add_(0, ex, _sq(seg))
        ok = torch.isfinite(sq)
        if not bool(ok.all()):
            keep = ok[ex]
            ex, uniq, seg = ex[keep], uniq[keep], seg[keep]
            # (local indices of the finite rows, in order)
            ex = torch.cumsum(ok.to(torch.long), 0)[ex] - 1
            rows, sq = rows[ok], sq[ok]
        c.formed = (rows, (rows[ex], uniq % vocab, seg)) if rows.numel() else None
        return rows, sq

    def weighted(self, c: _Call, groups: dict[str, int], w: _Weights) -> dict[str, Tensor]:
        x, b = c.a, c.b
        col = w.col(groups["weight"])
        formed = None
        if c.formed is not None:  # (the formed examples: 0 in the book-keeping, summed below)
            rows, formed = c.formed
            col = col.index_fill(0, rows, 0)
        bw = _scaled(b, col.view(-1, 1, 1))
        out = _bk_sum(b.shape[0], lambda sl: b.new_zeros(
            c.mod.num_embeddings, b.shape[2]).index_add_(0, x[sl].flatten(),
                                                         bw[sl].reshape(-1, b.shape[2])))
        if formed is not None:
            ex, tok, seg = formed
            out.index_add_(0, tok, _scaled(seg, w.col(groups["weight"])[ex].view(-1, 1)))
        return {"weight": out}

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
    seq_first = True
    def _reduce(self, mod: nn.Module, t: Tensor) -> Tensor:
        k = len(mod.normalized_shape)
        return t.reshape(t.shape[0], -1, *t.shape[t.ndim - k:]).sum(1)


class _LayerNormRule(_TrailingNormRule):
    def _xhat(self, mod: nn.Module, a: Tensor) -> Tensor:
        # (torch's C function, as F.layer_norm calls it: F.layer_norm's Python reads
        # torch.backends.cudnn.enabled through a Python descriptor a forward could replace,
        # run inside the reduction: 10.7 C, ninety-second hostile review; the flag only picks a
        # CUDA kernel, and layer_norm's kernels do not look at it)
        return _LAYER_NORM(a, mod.normalized_shape, None, None, mod.eps, True)


class _RMSNormRule(_TrailingNormRule):
    roles = ("weight",)

    def _xhat(self, mod: nn.Module, a: Tensor) -> Tensor:
        return _RMS_NORM(a, mod.normalized_shape, None, mod.eps)


class _ChannelNormRule(_AffineNormRule):
    def _reduce(self, mod: nn.Module, t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], t.shape[1], -1).sum(2)

    def per_example(self, c: _Call, role: str) -> Tensor:
        if c.group == 1:
            return super().per_example(c, role)
        # (B, k, C, ...): the statistics are per row (the channel dimension is dimension 1 of a
        # row), the gradient of example i the sum over its k rows
        a, b = c.a, c.b
        t = b if role == "bias" else b * self._xhat(c.mod, a.flatten(0, 1)).view_as(b)
        return t.reshape(t.shape[0], t.shape[1], t.shape[2], -1).sum((1, 3))


class _GroupNormRule(_ChannelNormRule):
    def _xhat(self, mod: nn.Module, a: Tensor) -> Tensor:
        return _GROUP_NORM(a, mod.num_groups, None, None, mod.eps, True)


class _EvalBatchNormRule(_ChannelNormRule):
    """BatchNorm with running statistics in eval mode: a fixed per-channel affine map.
    (Training-mode BatchNorm mixes examples and is refused before we get here.)"""

    def _xhat(self, mod: nn.Module, a: Tensor) -> Tensor:
        return _BATCH_NORM(a, None, None, mod.running_mean, mod.running_var, False, 0.0, mod.eps,
                           True)


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

#: the layer types the ghost engine supports (subclasses too, unless they override ``forward``,
#: attribute lookup or the call: :func:`dpclip.engine.plain_module.same_code`)
SUPPORTED_LAYERS: tuple[type, ...] = tuple(_RULES)


def _rule_for(mod: nn.Module) -> _Rule | None:
    from dpclip.engine.plain_module import class_data, instance_code, same_code

    if instance_code(mod) is not None:  # an instance forward: the per-layer path traces it
        return None
    rule = _RULES.get(type(mod))
    if rule is not None:
        return rule
    if _is_hf_conv1d(mod):
        return _CONV1D
    for base, rule in _RULES.items():
        if isinstance(mod, base) and same_code(type(mod), base) and \
                class_data(type(mod), base) is None:
            return rule
    return None


def _is_hf_conv1d(mod: nn.Module) -> bool:
    """Whether ``mod`` is a ``transformers`` ``Conv1D`` (or a subclass keeping its forward), without
    importing ``transformers`` (a model holding one has imported it already)."""
    from dpclip.engine.library_code import hf_conv1d

    cls = hf_conv1d()  # (transformers' own class and forward, checked against its source file)
    if cls is None or not isinstance(mod, cls):
        return False
    from dpclip.engine.plain_module import class_data, same_code

    return same_code(type(mod), cls) and class_data(type(mod), cls) is None


# ------------------------------------------------------------------------------ model scan


def layer_config(mod: nn.Module) -> list[tuple[str, Any]]:
    """A ruled layer's plain attributes (its configuration: ``padding``, ``stride``, ``eps``, the
    padding list, ...; not ``training`` or its hook dictionaries): values of plain types as they
    are, anything else by identity; its own parameters and buffers by identity and version; an
    attribute a data descriptor of its class hides, by that descriptor; its class's
    ``__getattribute__``. The rule reads them after the
    backward; a forward that changed them for the layer's call and put them back (nineteenth
    hostile review: a padding list that shifts the batch) ran another layer than the rule reads."""
    got: list[tuple[str, Any]] = []
    cls = type(mod)
    for k, v in vars(mod).items():
        if k in ("_parameters", "_buffers"):
            # its own tensors by identity and version: a buffer swapped for the call (eval
            # BatchNorm fed the batch's own statistics as running_mean / running_var, twentieth
            # hostile review: LOO 2.23 C) or written in place and written back
            got.append((k, tuple((n, ident(t), t._version if t is not None else None)
                                 for n, t in v.items())))
            continue
        if k == "training" or type(v) in (dict, collections.OrderedDict) or \
                isinstance(v, torch.Tensor):
            continue
        # (a data descriptor of the class, e.g. a property set on it for the call, would hide the
        # instance's value: twentieth hostile review, padding read through the class)
        shadow = _data_descriptor(cls, k)
        got.append((k, _frozen(v) if shadow is None else ("shadowed", ident(shadow))))
    got.append(("__getattribute__", ident(_class_attr(cls, "__getattribute__"))))
    return got


def _class_attr(cls: type, name: str) -> Any:
    for c in cls.__mro__:
        if name in c.__dict__:
            return c.__dict__[name]
    return None


def _data_descriptor(cls: type, name: str) -> Any:
    """The data descriptor (a property, ...) that class ``cls`` holds for ``name``, or None."""
    got = _class_attr(cls, name)
    if got is None:
        return None
    kind = type(got)
    return got if hasattr(kind, "__set__") or hasattr(kind, "__delete__") else None


def _frozen(v: Any, depth: int = 4) -> Any:
    """``v`` as a value that later changes of ``v`` do not change: plain values as they are,
    tuples and lists of them copied (with their type), anything else by identity."""
    if type(v) in (int, float, str, bool, type(None)):
        return v
    if depth > 0 and type(v) in (tuple, list):
        return (type(v).__name__, tuple(_frozen(x, depth - 1) for x in v))
    return ("id", type(v), ident(v))


class _Owner:
    """A module that owns trainable parameters directly, with the rule for its type."""

    __slots__ = ("name", "module", "rule", "roles", "pnames", "starts", "config")

    def __init__(self, name: str, module: nn.Module, rule: _Rule, roles: tuple[str, ...],
                 pnames: tuple[str, ...]) -> None:
        self.name = name
        self.module = module
        self.rule = rule
        #: a ruled layer's configuration when the step started (checked at its calls: the rule
        #: reads the layer's padding, stride, eps, ... after the backward, as they are then)
        self.config = layer_config(module) if rule.kind != "module" else None
        self.roles = roles  #: attribute names of its trainable parameters
        self.pnames = pnames  #: their canonical names (as in ``model.named_parameters()``)
        #: per-layer path: ``(autograd sequence number, captured arguments)`` at the entry of each
        #: call in progress (``enter``), taken by the call's ``_Call``
        self.starts: list[tuple[int, Any]] = []

    def enter(self, mod: nn.Module, args: tuple, kwargs: dict, match: Any = None) -> None:
        """Forward pre-hook of a per-layer module: where its call's autograd window starts, its
        arguments (with their tensors' versions, checked after the forward) and, with the step's
        :class:`~dpclip.engine.proved_program.ProgramMatch`, where its proved operations start."""
        captured = capture_args(args, kwargs, mod)
        call = None if match is None else match.open_call(
            [t for t, _ in captured[2]], {r: own_param(mod, r) for r in self.roles})
        self.starts.append((seq_now(), captured, call))


@dataclass(frozen=True)
class _Scan:
    params: dict[str, Tensor]  #: trainable parameters by canonical name, in model order
    owners: tuple[_Owner, ...]
    reasons: tuple[str, ...]  #: why the model is not supported (empty: supported)
    batchnorm: bool  #: the model has a BatchNorm layer
    by_module: dict[int, _Owner]  #: the owners by ``ident(module)``
    by_param: dict[int, str]  #: canonical names of the trainable parameters by ``ident(param)``
    per_layer: tuple[str, ...] = ()  #: modules on the per-layer path (no rule for their type)
