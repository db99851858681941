"""The compiled path of the ghost engine (``engine="compiled"``, and ``engine="auto"`` where the
graph is proved: ``AutoEngine(compiled=True)``): the batch-size proof's graph, proved per-example
separable ONCE, run on every step instead of the user's code (``docs/compiled_engine.md``,
milestones 1 and 3).

The traced ghost step proves every step by watching the user's forward run (the separability
tracer, the match against the proved program, the memory watch): about 85 us of Python per ATen
operation, most of the step of a Hugging Face model. Here the program is fixed instead:

1. **The graph.** :func:`~dpclip.engine.batch_symbol.proof_of` exports ``loss_fn(model(xs), ys)``
   with a symbolic batch size (``torch.export``, the ``make_fx`` machinery, on fake tensors) and
   checks that the batch size is used only as a size. That graph, its parameters, buffers and
   the step's inputs as placeholders, is the program every compiled step runs: no user code runs
   in a step.
2. **Its analysis, once per graph** (:func:`plan_of`), refusing what it cannot prove:

   * the graph: only ATen operations (no in-place or ``out=`` operation, no uninitialised
     memory, no grad-mode or autocast region, no other higher-order operation), one output (the
     per-example losses), no input or buffer mutation, every tensor input a parameter, a buffer or
     a step input (a tensor attribute that is not a buffer is refused);
   * every call of a ruled layer is the canonical operation of its class with its own
     parameters and configuration (``aten.linear`` with that ``nn.Linear``'s weight and bias,
     ``aten.embedding`` with the ``nn.Embedding``'s padding index, ``aten.layer_norm`` with the
     ``nn.LayerNorm``'s shape and eps, ``aten.addmm(bias, x.view(-1, nx), weight)`` for a
     ``transformers`` Conv1D, ...), and every use of a trainable parameter is such a call (a tied
     parameter: one input of the graph, the calls of every layer holding it; a layer called twice:
     two calls; the reduction's rule for several uses of a parameter): the ghost rule of the layer
     then reads exactly the per-example gradient of that operation. A module on ghost's per-layer
     path whose parameters meet the examples only by broadcasting (``p * x``, ``x + p``,
     ``p.expand(B, ...)``: Llama's RMSNorm, ViT's class token and position table), directly or
     after a chain that moves their entries without mixing them (Gemma's ``x * (1 +
     w.float())``, DeBERTa's split attention biases), is read by :class:`_BroadcastRule`, one
     call per use; an ``nn.Embedding`` or ``nn.LayerNorm`` subclass with a forward of its own
     (BART's scaled embeddings, ConvNeXt's channels-first LayerNorm) by its base class's rule at
     each canonical call. A layer called
     without the batch (a ``(1, T)`` position index) is read at the expansion the proof traced
     (:mod:`dpclip.engine.batchless`);
   * separability: the graph runs once on PUBLIC zeros at two batch sizes (primes that divide no
     size of the graph: a layout cannot come from a size coincidence) under the
     :class:`~dpclip.engine.separable.SeparabilityTracer` in its structural mode: a verdict that
     would read a value (a constant the same for every example, ``arange(B)`` as the identity)
     is taken from the graph's construction (the batch-size proof's uniform constants, the
     ``arange`` of the batch symbol moved without computing), never from values, which change
     from step to step. The losses and every ruled layer's input must be row separable, exactly
     as on a traced step; the two analyses must agree.

3. **Each step** (:meth:`Plan.run`): checks that no user code can run inside it (no torch function
   or dispatch mode, saved-tensor hooks, trace or profile function, Python kernel registered over
   an ATen operation, tensor subclass input; the graph runs as code of the engine's own that calls
   each operation's C++ entry point taken at analysis, :func:`_generate`: no patch of ``torch.ops``
   or of a module's ``__call__`` reaches it), that
   every ruled layer still has the configuration and parameters the analysis saw, then runs the
   graph with the model's current parameters and buffers and hands the ruled calls to the ghost
   reduction as the traced path does (the parameter-use count over the autograd graph, the rank
   checks, the rounding bounds: unchanged).

Privacy: the released sum is the clipped sum of the per-example gradients of THIS graph, a fixed
program proved per-example separable and free of the batch size for every batch size; whatever
the user's Python would do now (it does not run) cannot move it. Trust boundary: ``torch.export``'s
trace of the user's code decides WHICH program is trained, not whether it is private. A model whose
Python state changes what it computes without changing the proof's key (module types, plain
attributes, training flags, input signature) keeps training the captured program: call
:func:`reset` after changing such state. Not supported yet (refused, with the layer named): the
per-layer path beyond broadcast uses (of a parameter or of a chain from it, :func:`_chain_step`)
and the canonical calls of ``nn.Embedding``, ``nn.LayerNorm`` and ``nn.Linear`` subclasses
(:func:`_subclass_of`; Falcon's ``x @ W.T``: :func:`_matmul_call`), sequence-first layers,
in-place writes an alias would see (:func:`_out_of_place` runs the others out of place),
grad-mode regions.
"""

from __future__ import annotations

import operator
import re
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from dpclip._ident import ident
from dpclip.engine.batch import batch_leaves
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.generators import defaults_unchanged
from dpclip.engine.ghost_rules import (REWRITTEN, _CONV1D, _RULES, _Call, _MODULE, _Owner, _Rule,
                                      _row_group, layer_config, own_param)
from dpclip.engine.plain_module import ambient_user_code, python_callbacks
from dpclip.engine.proved_program import _LAST, _equal, foreign_aten_kernels
from dpclip.engine.separable import SeparabilityTracer, _meta
from dpclip.engine import _cm

__all__ = ["CompiledUnsupported", "Plan", "blocked", "plan_of", "reset"]

_aten = torch.ops.aten


def blocked() -> str | None:
    """Why no graph step can run now (user code that would run on the graph's operations: a
    torch function or dispatch mode, saved-tensor hooks, an interpreter callback, a Python kernel
    over an ATen operation; autocast), or None."""
    return (ambient_user_code() or python_callbacks()
            or ("Python kernels are registered over ATen operations"
                if foreign_aten_kernels() else None)
            or ("autocast is on" if _autocast_on() else None))


class CompiledUnsupported(Exception):
    """The graph cannot be proved for the compiled path (the message says why)."""


#: the canonical operation of each supported layer class: (overload, position of the input
#: argument, {argument name: how it must relate to the module})
_CANON: dict[type, Any] = {
    nn.Linear: _aten.linear.default,
    nn.Embedding: _aten.embedding.default,
    nn.LayerNorm: _aten.layer_norm.default,
    nn.Conv1d: _aten.conv1d.default,
    nn.Conv2d: _aten.conv2d.default,
    nn.GroupNorm: _aten.group_norm.default,
}
if hasattr(nn, "RMSNorm") and hasattr(_aten, "rms_norm"):
    _CANON[nn.RMSNorm] = _aten.rms_norm.default
#: BatchNorm in eval mode: the running statistics, buffers of the layer's own
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
for _bn in _BATCHNORMS:
    _CANON[_bn] = _aten.batch_norm.default

#: arithmetic on sizes (the batch symbol's expressions), emitted by :func:`_generate` as Python
#: syntax (plain ints at run time)
_INFIX = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.floordiv: "//",
          operator.truediv: "/", operator.mod: "%", operator.pow: "**", operator.eq: "==",
          operator.ne: "!=", operator.lt: "<", operator.le: "<=", operator.gt: ">",
          operator.ge: ">="}
#: the graph operations other than ATen's that the generated code runs
_SYM_OPS = frozenset(_INFIX) | {operator.neg, operator.getitem}
#: ATen packets whose output is uninitialised memory
_UNINIT = frozenset({_aten.empty, _aten.empty_like, _aten.new_empty, _aten.empty_strided,
                     _aten.new_empty_strided, _aten.empty_permuted})
#: value-keeping moves for the identity index (:func:`_iota_dims`)
_SAME_VALUES = frozenset({_aten.detach, _aten.alias, _aten.clone, _aten.contiguous,
                          _aten._to_copy, _aten.to, _aten.lift_fresh_copy})


class _BroadcastRule(_Rule):
    """A parameter of a module on ghost's per-layer path that meets example rows only through
    broadcasting: ``q * x`` (``product``: Llama's RMSNorm weight), ``x + q`` or ``q.expand(B,
    ...)`` (ViT's position embeddings and class token), ``q`` broadcast over the rows' leading
    dimensions (and any dimension where it has size 1), where ``q`` is the parameter itself or
    the end of a chain of operations that move its entries without mixing them (:data:`_CHAIN`:
    a cast, a shift by a number, a view, unsqueeze, permute or transpose: Gemma's RMSNorm ``x * (1
    + w.float())``, DeBERTa's ``q_bias[None, None, :]`` split into heads). The per-example
    gradient of ``q`` is ``b * x`` (``b``) summed over the broadcast dimensions; the chain's
    Jacobian maps it back to the parameter (each step's inverse: a cast back, the identity for
    a shift, the inverse view or permutation). Formed and kept as for a LayerNorm's weight (the
    vector whose norm is taken is the vector summed). One call per use, for the one parameter it
    uses."""

    roles = ("weight",)

    def __init__(self, product: bool, chain: tuple = (), shape: tuple | None = None,
                 negate: bool = False) -> None:
        self.product = product
        #: a ``where`` use with ``q`` as the value where the condition is false: the product is
        #: with the negated condition (:func:`_where_use`)
        self.negate = negate
        #: ``((op, args, in_shape, in_dtype), ...)`` from the parameter to ``q`` (:func:`_chain`)
        self.chain = chain
        #: the shape of ``q`` (the parameter's when there is no chain)
        self.shape = shape

    def prepare(self, c: _Call) -> None:
        """As every rule (:func:`_fold_rows`); a chain that computes in a narrower dtype than
        the parameter's (Gemma's ``w.float()`` of a float64 weight) has ``a`` and ``b`` widened
        to the parameter's dtype (exact): the vector is then formed, and its norm bounded, in
        that dtype, and the chunk's rounding terms are not the narrower dtype's."""
        super().prepare(c)
        want = own_param(c.mod, c.owner.roles[0]).dtype
        for name in ("a", "b"):
            t = getattr(c, name)
            if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != want and \
                    torch.finfo(t.dtype).eps > torch.finfo(want).eps:
                setattr(c, name, t.to(want))

    def per_example(self, c: _Call, role: str) -> Tensor:
        shape = self.shape if self.shape is not None else tuple(own_param(c.mod, role).shape)
        a = c.a.logical_not() if self.negate else c.a
        t = c.b * a if self.product else c.b
        rest = tuple(t.shape[1:])
        tail = shape[1:] if len(shape) == len(rest) + 1 else shape  # (a leading 1: the batch's)
        if len(rest) > len(tail):
            t = t.reshape(t.shape[0], -1, *rest[len(rest) - len(tail):]).sum(1)
        dims = [d + 1 for d, n in enumerate(tail) if n == 1 and t.shape[d + 1] != 1]
        if dims:
            t = t.sum(dims, keepdim=True)
        t = t.reshape(t.shape[0], *shape)
        for op, args, in_shape, in_dtype in reversed(self.chain):  # (q's gradient, pulled back)
            t = _pull_back(t, op, args, in_shape, in_dtype)
        return t


def _pull_back(t: Tensor, op: Any, args: tuple, in_shape: tuple, in_dtype: torch.dtype) -> Tensor:
    """Per-example gradients ``t`` (batch first) of one chain step's output, as gradients of its
    input: the transpose of the step's Jacobian (a permutation of the entries, or the identity,
    with a cast back to the input's dtype)."""
    if op in (_aten.to.dtype, _aten._to_copy.default):  # (never narrowed: a bfloat16 weight's
        # vectors stay in the chain's float32, as a half weight's kept gradients do)
        return t.to(in_dtype) if torch.finfo(in_dtype).eps < torch.finfo(t.dtype).eps else t
    if op in (_aten.add.Tensor, _aten.sub.Tensor):
        return t
    if op is _aten.permute.default:
        dims = [d % len(in_shape) for d in args[0]]
        inv = sorted(range(len(dims)), key=dims.__getitem__)
        return t.permute(0, *[i + 1 for i in inv])
    if op is _aten.transpose.int:
        n = max(len(in_shape), 1)
        return t.transpose(args[0] % n + 1, args[1] % n + 1)
    if op is _aten.t.default:
        return t.transpose(1, 2) if len(in_shape) == 2 else t
    # unsqueeze, view, reshape, _unsafe_view: the same entries in the input's shape
    return t.reshape(t.shape[0], *in_shape)


class _LookupThrough(_Rule):
    """An ``nn.Embedding`` looked up at constant ids with no batch dimension (T5's and MPNet's
    relative position buckets, ``(T, T)``), whose output meets the example rows only through
    broadcast uses of it or of a chain from it (:func:`_uses_from`: T5 permutes it to ``(1, H,
    T, T)`` and masks it with ``where``, MPNet expands it to the batch). One call per use: the
    use's :class:`_BroadcastRule` gives example ``i``'s gradient of the lookup's output (the
    use's gradient row ``i``, pulled back through the chain), scattered into the table's rows at
    the ids (``c.args``; the padding row's gradient is zero, as in ``aten.embedding``). Formed
    and kept (``(B, V, H)``): the vector whose norm is taken is the vector summed."""

    roles = ("weight",)

    def __init__(self, use: _BroadcastRule, graph_use: bool = True) -> None:
        self.use = use
        #: whether this call stands for the lookup's one use of the table in the autograd graph
        #: (the first use of the lookup's output; its other uses' calls are the same graph use:
        #: ghost's count of each parameter's graph uses against its calls counts one)
        self.graph_use = graph_use

    def prepare(self, c: _Call) -> None:
        self.use.prepare(c)

    def per_example(self, c: _Call, role: str) -> Tensor:
        t = self.use.per_example(c, role)  # (B, *the lookup's output shape)
        ids = c.args
        w = own_param(c.mod, role)
        rows = t.reshape(t.shape[0], -1, w.shape[1])
        g = rows.new_zeros((t.shape[0], w.shape[0], w.shape[1]))
        g.index_add_(1, ids.reshape(-1), rows)
        pad = c.mod.padding_idx
        if pad is not None:
            g[:, pad] = 0
        return g


_SCALE = _BroadcastRule(product=True)
_SHIFT = _BroadcastRule(product=False)
#: operations a parameter may pass through before its broadcast use (:func:`_chain_step`): each
#: moves the entries of one tensor without mixing them, or shifts them by a number
_CHAIN = frozenset({_aten.to.dtype, _aten._to_copy.default, _aten.add.Tensor, _aten.sub.Tensor,
                    _aten.unsqueeze.default, _aten.view.default, _aten.reshape.default,
                    _aten._unsafe_view.default, _aten.permute.default, _aten.transpose.int,
                    _aten.t.default})
#: operations that only assert on a tensor's metadata (no output): not uses
_ASSERTS = frozenset({_aten._assert_tensor_metadata.default}
                    if hasattr(_aten, "_assert_tensor_metadata") else ())
#: the longest chain :func:`_chain_step` follows from a parameter to its broadcast use
_CHAIN_MAX = 16


def _fits(p: Tensor, rows: Tensor) -> bool:
    """Whether ``p`` broadcasts against example rows ``rows`` (batch first) without touching the
    batch dimension or enlarging ``rows``: right-aligned, each size of ``p`` 1 or ``rows``'s,
    and a leading size of ``p`` at the batch's position 1."""
    if p.ndim > rows.ndim or not p.ndim:
        return False
    r = _sizes(rows.shape)[rows.ndim - p.ndim:]
    if p.ndim == rows.ndim and p.shape[0] != 1:
        return False
    return all(a == 1 or a == b for a, b in zip(_sizes(p.shape), r))


def _static(v: Any) -> bool:
    """A tensor value whose sizes are all plain ints (no batch symbol)."""
    return isinstance(v, Tensor) and all(type(d) is int for d in v.shape)


def _number(v: Any) -> bool:
    return type(v) in (int, float)


def _chain_step(u: torch.fx.Node, q: torch.fx.Node) -> tuple | None:
    """``(op, args, in_shape, in_dtype)`` when ``u`` is one step of a parameter's chain applied to
    ``q`` (:data:`_CHAIN`: its entries moved without mixing, or shifted by a number), else None.
    The step's output has plain sizes (no batch) and a floating dtype."""
    qv, uv = q.meta.get("val"), u.meta.get("val")
    if u.target not in _CHAIN or not _static(qv) or not _static(uv) or \
            not qv.dtype.is_floating_point or not uv.dtype.is_floating_point or \
            not u.args or u.args[0] is not q:
        return None
    op, args, kw = u.target, tuple(u.args[1:]), dict(u.kwargs)
    if any(isinstance(a, torch.fx.Node) for a in args):
        return None
    if op is _aten.to.dtype:
        ok = not kw and len(args) == 1
    elif op is _aten._to_copy.default:
        ok = not args and set(kw) <= {"dtype"}
    elif op in (_aten.add.Tensor, _aten.sub.Tensor):
        ok = not kw and len(args) == 1 and _number(args[0])
    elif op is _aten.t.default:
        ok = not kw and not args
    elif op in (_aten.unsqueeze.default, ):
        ok = not kw and len(args) == 1 and type(args[0]) is int
    elif op is _aten.transpose.int:
        ok = not kw and len(args) == 2 and all(type(a) is int for a in args)
    else:  # view, reshape, _unsafe_view, permute: one list of plain ints
        ok = not kw and len(args) == 1 and isinstance(args[0], (list, tuple)) and \
            all(type(a) is int for a in args[0])
    if not ok or (op not in (_aten.to.dtype, _aten._to_copy.default) and uv.dtype != qv.dtype) \
            or uv.numel() != qv.numel():
        return None
    return op, args, tuple(qv.shape), qv.dtype


def _broadcast_uses(o: Any, nodes: dict[str, torch.fx.Node]) -> list | None:
    """The uses of a per-layer module's trainable parameters (``role -> placeholder``) when every
    one is a broadcast use (:class:`_BroadcastRule`) of the parameter or of a chain from it
    (:func:`_chain_step`): ``[(role, use, x, rule)]``; else None."""
    got = []
    for role, node in nodes.items():
        uses = _uses_from(node)
        if uses is None:
            return None
        got += [(role, u, x, rule) for u, x, rule in uses]
    return got


def _uses_from(node: torch.fx.Node) -> list | None:
    """``[(use, x, rule)]`` when every use of ``node``'s value (a parameter, or the batch-less
    output of a lookup: :class:`_LookupThrough`) is a broadcast use of it or of a chain from it
    (:func:`_chain_step`, :func:`_use`, :func:`_where_use`), else None."""
    if not isinstance(node.meta.get("val"), Tensor):
        return None
    got = []
    todo = [(node, ())]
    while todo:
        q, chain = todo.pop()
        qv = q.meta.get("val")
        users = [u for u in q.users if u.target not in _ASSERTS]
        if not users:  # (an unused parameter or a chain that ends nowhere)
            return None
        for u in users:
            step = _chain_step(u, q)
            if step is not None:
                if len(chain) >= _CHAIN_MAX:
                    return None
                todo.append((u, chain + (step,)))
                continue
            negate = False
            use = _use(u, q, qv)
            if use is None:
                use = _where_use(u, q, qv)
                if use is None:
                    return None
                x, negate = use
                product = True
            else:
                x, product = use
            rule = _BroadcastRule(product, chain, tuple(qv.shape), negate) \
                if chain or negate else (_SCALE if product else _SHIFT)
            got.append((u, x, rule))
    return got


#: ``where`` with two tensors or a number in either value position
_WHERE = frozenset({_aten.where.self, _aten.where.ScalarOther, _aten.where.ScalarSelf})


def _where_use(u: torch.fx.Node, q: torch.fx.Node, p: Tensor) -> tuple | None:
    """``(cond, negate)`` when ``u`` is ``where(cond, q, other)`` (``negate`` False) or
    ``where(cond, other, q)`` (True) whose result holds example rows (the batch symbol leading),
    ``p`` (the value of ``q``) fitting against them (:func:`_fits`), ``cond`` a boolean tensor
    broadcasting to the result with its leading size the batch's or 1, ``other`` a number or
    another tensor of the result's dtype (not ``q``): the gradient of ``q`` is the result's
    gradient where ``cond`` (where not ``cond``) holds, summed over the broadcast dimensions
    (T5's relative position bias masked by the padding mask); else None."""
    out = u.meta.get("val")
    if u.target not in _WHERE or u.kwargs or len(u.args) != 3 or \
            not isinstance(out, Tensor) or out.dtype != p.dtype or not out.ndim or \
            not isinstance(out.shape[0], torch.SymInt):
        return None
    cond, first, second = u.args
    if (first is q) == (second is q) or cond is q or not isinstance(cond, torch.fx.Node):
        return None
    other = second if first is q else first
    ov = other.meta.get("val") if isinstance(other, torch.fx.Node) else other
    if not (_number(ov) or (isinstance(ov, Tensor) and ov.dtype == out.dtype)):
        return None
    cv = cond.meta.get("val")
    if not isinstance(cv, Tensor) or cv.dtype != torch.bool or cv.ndim != out.ndim or \
            not (cv.shape[0] == 1 or _sizes(cv.shape)[:1] == _sizes(out.shape)[:1]) or \
            not all(a == 1 or a == b for a, b in zip(_sizes(cv.shape), _sizes(out.shape))) or \
            not _fits(p, out):
        return None
    return cond, first is not q


def _use(u: torch.fx.Node, q: torch.fx.Node, p: Tensor) -> tuple | None:
    """``(x, product)`` when ``u`` is a broadcast use of ``q`` (value ``p``): ``p * x``, ``x + p``
    with ``p`` fitting against example rows ``x`` (:func:`_fits`), or ``p`` (leading size 1)
    expanded to the batch (``x`` is then ``u``); else None."""
    out = u.meta.get("val")
    if not isinstance(out, Tensor) or out.dtype != p.dtype or u.kwargs:
        return None
    if u.target is _aten.expand.default:
        # p (1, ...) expanded to the batch: its rows are the batch's copies of p
        if p.shape[0] != 1 or out.ndim != p.ndim or \
                not isinstance(out.shape[0], torch.SymInt) or \
                _sizes(out.shape[1:]) != _sizes(p.shape[1:]):
            return None
        return u, False
    if u.target not in (_aten.mul.Tensor, _aten.add.Tensor) or len(u.args) != 2:
        return None
    x = u.args[1] if u.args[0] is q else u.args[0]
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if x is q or not isinstance(xv, Tensor) or xv.dtype != out.dtype or \
            _sizes(xv.shape) != _sizes(out.shape) or not _fits(p, xv):
        return None
    return x, u.target is _aten.mul.Tensor


def _embedding_subclass(o: Any) -> str | None:
    """Why a per-layer module cannot take the Embedding rule for its table (None: it can): a
    subclass of ``nn.Embedding`` with a forward of its own (BART's and Gemma's scaled word
    embeddings, OPT's learned positions), trainable weight only, whose classes below
    ``nn.Embedding`` define none of what the rule reads (a property there would run the class's
    code in the reduction), and which the rule supports (no ``max_norm``, no frequency
    scaling, ``num_embeddings`` the table's rows: :meth:`_EmbeddingRule.unsupported`). Its calls are then found in the graph as for
    ``nn.Embedding`` itself: every use of the weight must be a canonical lookup
    (:func:`_canonical`), whatever the forward computes around it (the scale, the ids)."""
    mod = o.module
    cls = type(mod)
    if not isinstance(mod, nn.Embedding) or cls is nn.Embedding or o.roles != ("weight",):
        return "not an nn.Embedding subclass with a trainable weight alone"
    # (any class of its MRO but nn.Embedding's, nn.Module's and object's: a mixin after
    # nn.Module too, hundred-and-seventy-fourth review; per_layer.embedding_class_defines)
    return _RULES[nn.Embedding].unsupported(mod)


#: what the LayerNorm rule and its checks read of a layer: a class below ``nn.LayerNorm`` that
#: defines one of them (a property answering two reads differently) keeps the layer off the rule
LAYERNORM_READS = ("normalized_shape", "eps", "elementwise_affine", "weight", "bias",
                   "__getattr__", "__getattribute__", "__setattr__", "__class__", "__dict__")


def _layernorm_subclass(o: Any) -> str | None:
    """Why a per-layer module cannot take the LayerNorm rule (None: it can): a subclass of
    ``nn.LayerNorm`` with a forward of its own (ConvNeXt's channels-first LayerNorm, a permute
    around ``super().forward``), an affine weight (and bias) trainable, whose classes other
    than ``nn.LayerNorm``, ``nn.Module`` and ``object`` (anywhere in the MRO, a mixin after
    ``nn.Module`` too: the hundred-and-seventy-fourth review's attack on the Embedding rule)
    define nothing the rule reads (:data:`LAYERNORM_READS`). Every use of its parameters must
    then be a canonical ``aten.layer_norm`` with its own weight, bias, shape and eps
    (:func:`_canonical`); what the forward does around it is graph code like any other."""
    mod = o.module
    if not isinstance(mod, nn.LayerNorm) or type(mod) is nn.LayerNorm or \
            not mod.elementwise_affine or o.roles not in (("weight",), ("weight", "bias")):
        return "not an nn.LayerNorm subclass with a trainable affine weight"
    return _plain_subclass(o, nn.LayerNorm, LAYERNORM_READS)


def _plain_subclass(o: Any, base: type, reads: tuple[str, ...]) -> str | None:
    """Why a subclass of ``base`` cannot be read by ``base``'s rule, whatever its forward (None:
    it can): a bias that exists is trainable with the weight; its instance dictionary is a plain
    ``dict`` (a subclass could answer a check's item reads otherwise than attribute lookup,
    hundred-and-eighty-fourth hostile review); no class of its MRO but ``base``, ``nn.Module``
    and ``object`` defines one of ``reads`` (a property answering two reads differently)."""
    mod = o.module
    if getattr(mod, "bias", None) is not None and "bias" not in o.roles:
        return "its bias is frozen while its weight trains"
    if type(vars(mod)) is not dict:
        return "its instance dictionary (__dict__) is not a plain dict"
    for c in type(mod).__mro__:
        if c is base or c is nn.Module or c is object:
            continue
        hit = [k for k in reads if k in vars(c)]
        if hit:
            return f"its class {c.__name__} defines {hit[0]}"
    return None


#: what the Linear rule and its checks read of a layer (as :data:`LAYERNORM_READS`)
LINEAR_READS = ("in_features", "out_features", "weight", "bias", "__getattr__",
                "__getattribute__", "__setattr__", "__class__", "__dict__")


def _linear_subclass(o: Any) -> str | None:
    """Why a per-layer module cannot take the Linear rule (None: it can): a subclass of
    ``nn.Linear`` with a forward of its own (Falcon's ``FalconLinear``: ``x @ self.weight.T`` then
    ``+ self.bias``), its weight trainable (and its bias, if it has one), whose classes other than
    ``nn.Linear``, ``nn.Module`` and ``object`` define nothing the rule reads
    (:data:`LINEAR_READS`). Its calls: a canonical ``aten.linear``, or :func:`_matmul_call`."""
    mod = o.module
    if not isinstance(mod, nn.Linear) or type(mod) is nn.Linear or \
            o.roles not in (("weight",), ("weight", "bias")):
        return "not an nn.Linear subclass with a trainable weight"
    return _plain_subclass(o, nn.Linear, LINEAR_READS)


#: a 2-D weight transposed: ``W.T``, ``W.t()``, ``W.transpose(0, 1)``, ``W.permute(1, 0)``
_TRANSPOSES = frozenset({_aten.numpy_T.default, _aten.t.default, _aten.transpose.int,
                         _aten.permute.default})


def _matmul_call(t: torch.fx.Node, mod: nn.Module,
                 ph: dict[str, torch.fx.Node]) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(call, input)`` when ``t``, a user of an ``nn.Linear`` subclass's weight, is the weight
    transposed and used once, as ``aten.matmul(x, t)`` with ``x`` of two or more dimensions whose
    last is ``in_features`` (``x @ W.T``: ``linear(x, W)`` exactly); with a trainable bias, the
    product's only use must be ``aten.add.Tensor(product, bias)`` (the call is then that add:
    its output gradient is the product's). Else None."""
    w = ph["weight"]
    if t.target not in _TRANSPOSES or not t.args or t.args[0] is not w or t.kwargs:
        return None
    rest = tuple(t.args[1:])
    if t.target is _aten.transpose.int and sorted(d % 2 for d in rest) != [0, 1] or \
            t.target is _aten.permute.default and [d % 2 for d in rest[0]] != [1, 0] or \
            t.target in (_aten.numpy_T.default, _aten.t.default) and rest:
        return None
    wv = w.meta.get("val")
    if not isinstance(wv, Tensor) or wv.ndim != 2 or len(t.users) != 1:
        return None
    mm = next(iter(t.users))
    if mm.target is not _aten.matmul.default or mm.kwargs or len(mm.args) != 2 or \
            mm.args[1] is not t or not isinstance(mm.args[0], torch.fx.Node):
        return None
    x = mm.args[0]
    xv, mv = x.meta.get("val"), mm.meta.get("val")
    if not isinstance(xv, Tensor) or xv.ndim < 2 or xv.shape[-1] != wv.shape[1] or \
            not isinstance(mv, Tensor) or mv.ndim != xv.ndim or xv.dtype != wv.dtype:
        return None
    if type(vars(mod)) is not dict or any(n not in vars(mod) or not _strictly_plain(vars(mod)[n])
                                          for n in _CONFIG_READS[nn.Linear]):
        return None
    if "bias" not in ph:
        return mm, x
    bv = ph["bias"].meta.get("val")
    if not isinstance(bv, Tensor) or tuple(bv.shape) != (wv.shape[0],):
        # (a bias of another shape, (out, 1) or (T, out), broadcasts otherwise than the Linear
        # rule's sum over positions reads it; hundred-and-eighty-first hostile review)
        return None
    users = list(mm.users)
    if len(users) != 1:
        return None
    add = users[0]
    if add.target is not _aten.add.Tensor or add.kwargs or len(add.args) != 2 or \
            add.args[0] is not mm or add.args[1] is not ph["bias"]:
        return None
    return add, x


#: ``nn.Embedding``, ``nn.LayerNorm`` and ``nn.Linear`` subclasses with a forward of their own whose canonical
#: calls take the base class's rule: the base and why a layer cannot (None: it can)
_SUBCLASSED = ((nn.Embedding, _embedding_subclass), (nn.LayerNorm, _layernorm_subclass),
               (nn.Linear, _linear_subclass))


def _subclass_of(o: Any) -> type | None:
    """The base class whose rule a per-layer module's canonical calls take, or None."""
    return next((base for base, why in _SUBCLASSED
                 if isinstance(o.module, base) and why(o) is None), None)


def _fqn(owner: str, attr: str) -> str:
    """The model's name for attribute ``attr`` of the layer the scan names ``owner`` (the model
    itself is ``<root>``)."""
    return attr if owner in ("", "<root>") else f"{owner}.{attr}"


def _sizes(shape: Any) -> tuple:
    return tuple(d.node.expr if isinstance(d, torch.SymInt) else d for d in shape)


def _mod_args(node: torch.fx.Node, mod: nn.Module, gm: torch.fx.GraphModule) -> dict | None:
    """The call's arguments by name (defaults filled in from the schema)."""
    got = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    if got is None:
        return None
    kw = dict(got.kwargs)
    for a in node.target._schema.arguments:
        if a.name not in kw and a.has_default_value():
            kw[a.name] = a.default_value
    return kw


def _canonical(node: torch.fx.Node, mod: nn.Module, ph: dict[str, torch.fx.Node],
               gm: torch.fx.GraphModule, conv1d: bool = False,
               as_cls: type | None = None) -> tuple[str | None, Any]:
    """``(why not, the input argument)``: whether ``node`` is exactly ``mod``'s own forward
    (its class's canonical operation with its own parameters and configuration). ``conv1d``: a
    ``transformers`` Conv1D, ``addmm(bias, x.view(-1, nx), weight)``: its input is the 2-D view
    (each example's ``T`` rows: the layout ``(0, T)``)."""
    cls = type(mod) if as_cls is None else as_cls  # (an nn.Embedding subclass: as nn.Embedding)
    want = _aten.addmm.default if conv1d else _CANON.get(cls)
    if want is None or node.target is not want:
        return (f"it is not computed by {getattr(want, '__name__', want)} "
                f"(found {getattr(node.target, '__name__', node.target)})"), None
    kw = _mod_args(node, mod, gm)
    if kw is None:
        return "its arguments could not be read", None
    if type(vars(mod)) is not dict:
        # (a dict subclass answered the check's reads with plain values while attribute
        # lookup, reading its storage, gave the rule review 180's lying shape: 3.9 C under
        # compiled, auto and make_private; hundred-and-eighty-fourth hostile review)
        return "its instance dictionary (__dict__) is not a plain dict", None
    bad = next((n for n in _CONFIG_READS.get(cls, ()) if n not in vars(mod) or
                not _strictly_plain(vars(mod)[n])), None)
    if bad is not None:
        # (a tuple subclass whose iteration answers (C,) and whose contents, which torch's
        # argument parser reads in the rule, are (32, C): the LayerNorm rule normalised over
        # the chunk's 32 rows, 11.8 C under compiled, auto and make_private; hundred-and-
        # eightieth hostile review)
        return (f"its {bad} is not an instance attribute of plain type (int, float, bool, str, "
                "None, or an exact tuple or list of them)"), None

    def param(role: str, got: Any) -> str | None:
        p = mod._parameters.get(role)
        if p is None:
            return None if got is None else f"its {role} argument is not the layer's"
        if got is not ph.get(role):
            return f"its {role} argument is not the layer's own {role}"
        return None

    def plain(v: Any) -> Any:  # (FX's immutable_list, tuples: as lists of plain values)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v if type(v) in (int, float, bool, str, type(None)) else ("other", id(v))

    def same(name: str, value: Any) -> str | None:
        got = plain(kw.get(name))
        value = plain(value)
        return None if got == value and type(got) is type(value) or (
            type(got) in (int, float) and type(value) in (int, float) and got == value) \
            else f"its {name} is not the layer's ({got!r} against {value!r})"

    checks: list[str | None]
    if conv1d:
        a = kw.get("mat1")
        checks = [param("weight", kw.get("mat2")), param("bias", kw.get("input")),
                  same("beta", 1), same("alpha", 1)]
    elif cls is nn.Linear:
        a = kw.get("input")
        checks = [param("weight", kw.get("weight")), param("bias", kw.get("bias"))]
    elif cls is nn.Embedding:
        a = kw.get("indices")
        if mod.max_norm is not None:
            return "max_norm renormalises the table in place", None
        checks = [param("weight", kw.get("weight")),
                  same("padding_idx", -1 if mod.padding_idx is None else mod.padding_idx),
                  same("scale_grad_by_freq", bool(mod.scale_grad_by_freq)),
                  same("sparse", bool(mod.sparse))]
    elif cls is nn.LayerNorm:
        a = kw.get("input")
        checks = [param("weight", kw.get("weight")), param("bias", kw.get("bias")),
                  same("normalized_shape", list(mod.normalized_shape)), same("eps", mod.eps)]
    elif cls in (nn.Conv1d, nn.Conv2d):
        a = kw.get("input")
        if mod.padding_mode != "zeros" or isinstance(mod.padding, str):
            return "only padding_mode 'zeros' with numeric padding is supported here", None
        checks = [param("weight", kw.get("weight")), param("bias", kw.get("bias")),
                  same("stride", list(mod.stride)), same("padding", list(mod.padding)),
                  same("dilation", list(mod.dilation)), same("groups", mod.groups)]
    elif cls in _BATCHNORMS:
        a = kw.get("input")
        if not mod.track_running_stats or "running_mean" not in ph or "running_var" not in ph:
            return "it does not normalise with the layer's running statistics", None
        checks = [param("weight", kw.get("weight")), param("bias", kw.get("bias")),
                  None if kw.get("running_mean") is ph["running_mean"] else
                  "its running mean is not the layer's",
                  None if kw.get("running_var") is ph["running_var"] else
                  "its running variance is not the layer's",
                  same("training", False), same("eps", mod.eps)]
    elif cls is nn.GroupNorm:
        a = kw.get("input")
        checks = [param("weight", kw.get("weight")), param("bias", kw.get("bias")),
                  same("num_groups", mod.num_groups), same("eps", mod.eps)]
    else:  # RMSNorm
        a = kw.get("input")
        checks = [param("weight", kw.get("weight")),
                  same("normalized_shape", list(mod.normalized_shape)),
                  None if kw.get("eps") == mod.eps else
                  f"its eps is not the layer's ({kw.get('eps')!r} against {mod.eps!r})"]
    bad = next((c for c in checks if c is not None), None)
    if bad is not None:
        return bad, None
    if not isinstance(a, torch.fx.Node):
        return "its input is not a tensor of the graph", None
    return None, a


#: the configuration each rule reads of its layer (besides its parameters and buffers): each must
#: be an instance attribute of a plain type (:func:`_strictly_plain`), compared with the graph's
#: call by :func:`_canonical` and with the analysis's value at every step (``_static_config``)
_CONFIG_READS: dict[type, tuple[str, ...]] = {
    nn.Linear: ("in_features", "out_features"),
    nn.Embedding: ("num_embeddings", "embedding_dim", "padding_idx", "max_norm",
                   "scale_grad_by_freq", "sparse"),
    nn.LayerNorm: ("normalized_shape", "eps", "elementwise_affine"),
    nn.Conv1d: ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
                "groups", "padding_mode"),
    nn.GroupNorm: ("num_groups", "num_channels", "eps", "affine"),
}
_CONFIG_READS[nn.Conv2d] = _CONFIG_READS[nn.Conv1d]
if hasattr(nn, "RMSNorm"):
    _CONFIG_READS[nn.RMSNorm] = ("normalized_shape", "eps", "elementwise_affine")
for _bn in _BATCHNORMS:
    _CONFIG_READS[_bn] = ("num_features", "eps", "track_running_stats")


def _strictly_plain(v: Any) -> bool:
    """``v`` an int, float, bool, str or None, or an exact tuple or list of such values (no
    subclass: its ``__iter__``, ``__len__`` or ``__eq__`` could answer other than its contents,
    which torch's argument parser reads)."""
    if type(v) in (tuple, list):
        return all(_strictly_plain(x) for x in v)
    return type(v) in (int, float, bool, str, type(None))


def _literal(model: nn.Module, target: Any) -> bool:
    """Whether an exported constant is a tensor the forward's code makes (``torch.tensor(...)``:
    ``torch.export`` names it ``<module path>.lifted_tensor_<n>``), not an attribute of a module
    (which the user can change between steps without the proof seeing it)."""
    if not isinstance(target, str):
        return False
    path, _, attr = target.rpartition(".")
    if not re.fullmatch(r"lifted_tensor_\d+", attr):
        return False
    try:
        mod = model.get_submodule(path) if path else model
    except AttributeError:
        return False
    return attr not in vars(mod) and not hasattr(type(mod), attr)


def _static_config(mod: nn.Module) -> list:
    """The layer's configuration without its parameters' versions (the optimiser writes them)."""
    return [(k, v) for k, v in layer_config(mod) if k not in ("_parameters", "_buffers")]


def _prime_batches(gm: torch.fx.GraphModule, shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """Two primes that divide no static size of the graph nor of its inputs: at such a batch size
    no size of the analysis is a multiple of it unless the batch symbol made it so."""
    sizes: set[int] = set()
    for n in gm.graph.nodes:
        for v in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(v, Tensor):
                sizes.update(int(s) for s in v.shape if isinstance(s, int))
    for s in shapes:
        sizes.update(s)
    sizes = {s for s in sizes if s > 1}
    found: list[int] = []
    p = 5
    while len(found) < 2:
        if all(p % q for q in range(2, int(p ** 0.5) + 1)) and all(s % p for s in sizes):
            found.append(p)
        p += 1
    return found[0], found[1]


def _dtype(n: Any) -> Any:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return v.dtype if isinstance(v, Tensor) else None


def _iota_dims(gm: torch.fx.GraphModule, batch_expr: Any) -> dict[str, int]:
    """Graph nodes that are ``arange(B)`` along one dimension by construction: name -> that
    dimension. ``arange`` of exactly the batch symbol (start 0, step 1), then only moves that keep
    every value at its index along that dimension (unsqueeze, expand of the other dimensions,
    copies, a full slice)."""
    out: dict[str, int] = {}

    def shape(n: Any) -> tuple | None:  # (sizes as expressions: compared without guards)
        v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        return tuple(d.node.expr if isinstance(d, torch.SymInt) else d for d in v.shape) \
            if isinstance(v, Tensor) else None

    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        pk = n.target.overloadpacket
        src = n.args[0] if n.args else None
        if n.target is _aten.arange.default and len(n.args) == 1 and _dtype(n) == torch.int64:
            end = n.args[0]
            val = end.meta.get("val") if isinstance(end, torch.fx.Node) else None
            if isinstance(val, torch.SymInt) and val.node.expr == batch_expr:
                out[n.name] = 0
            continue
        if not isinstance(src, torch.fx.Node) or src.name not in out:
            continue
        d = out[src.name]
        s_in, s_out = shape(src), shape(n)
        if s_in is None or s_out is None:
            continue
        if pk in _SAME_VALUES and s_in == s_out:
            # every value kept exactly: int64 in, int64 out, whatever the overload spells
            # (.bool().long() or an int8 round trip change values: sixty-sixth hostile review,
            # 8.34 C and 7.36 C)
            if _dtype(src) == torch.int64 and _dtype(n) == torch.int64:
                out[n.name] = d
        elif pk is _aten.unsqueeze:
            k = n.args[1] % len(s_out)
            out[n.name] = d + 1 if k <= d else d
        elif pk is _aten.expand and len(s_out) == len(s_in) and s_out[d] == s_in[d]:
            out[n.name] = d
        elif pk is _aten.slice and s_in == s_out and \
                (len(n.args) < 3 or n.args[2] in (0, None)) and \
                (len(n.args) < 5 or n.args[4] == 1):
            out[n.name] = d
    return out


def _claim(o: Any, roles: tuple, ph: dict, slot: dict, call: torch.fx.Node, a: torch.fx.Node,
           specs: list, ruled: dict, expansions: dict, extra: list) -> None:
    """Record one canonical call of owner ``o``: its spec, and the graph outputs the step reads
    (the input and output; a batch-less call expanded by the proof's program,
    :func:`~dpclip.engine.batchless.as_example_rows`, is read at the expansion, its only use)."""
    if call.name in ruled:  # (two parameters in one operation, p * q: not a broadcast use)
        raise CompiledUnsupported(
            f"the operation {call.name!r} uses two parameters of layer(s) "
            f"{ruled[call.name].name!r} and {o.name!r}; the compiled engine reads one per call")
    spec = _Spec(o.name, o.module, roles)
    spec.slots = {r: slot[ph[r].name] for r in roles}
    spec.a_node = a
    spec.call = call.name
    specs.append(spec)
    ruled[call.name] = spec
    val = call.meta.get("val")
    if isinstance(val, Tensor) and val.ndim and val.shape[0] == 1:
        users_out = list(call.users)
        if len(users_out) == 1 and users_out[0].target is _aten.add.Tensor and \
                users_out[0].args[0] is call and _rows_of(users_out[0], val):
            spec.expanded = True
            expansions[users_out[0].name] = spec
            extra += [a, users_out[0], call]
            spec.a_at, spec.out_at, spec.source_at = len(extra) - 2, len(extra) - 1, len(extra)
            return
    extra += [a, call]
    spec.a_at, spec.out_at = len(extra) - 1, len(extra)


def _lookup_uses(mod: nn.Module, call: torch.fx.Node, ids: Any) -> list | None:
    """The broadcast uses (:func:`_uses_from`) of an ``nn.Embedding`` lookup whose ids and output
    have no batch dimension (plain sizes, the ids at least 1-D) and which the proof did not
    expand (a ``(1, T)`` lookup added to the rows: :func:`_claim`): :class:`_LookupThrough`;
    else None."""
    val = call.meta.get("val")
    iv = ids.meta.get("val") if isinstance(ids, torch.fx.Node) else None
    if type(mod) is not nn.Embedding or not _static(val) or not _static(iv) or not iv.ndim or \
            iv.dtype not in (torch.int64, torch.int32):
        return None
    users = list(call.users)
    if val.ndim and val.shape[0] == 1 and len(users) == 1 and \
            users[0].target is _aten.add.Tensor and users[0].args[0] is call and \
            _rows_of(users[0], val):
        return None
    uses = _uses_from(call)
    if uses is None:
        return None
    # (a use of the lookup's output itself reads it in the output's shape, never the table's:
    # the shared _SCALE / _SHIFT rules take the parameter's shape, an Embedding on arange(T)
    # added to the token embeddings failed to reshape, CI rehearsal of this session)
    out = tuple(val.shape)
    return [(u, x, _BroadcastRule(r.product, r.chain, out, r.negate) if r.shape is None else r)
            for u, x, r in uses]


def _rows_of(node: torch.fx.Node, one: Tensor) -> bool:
    """Whether ``node``'s value is ``one`` (leading dimension 1) with the batch symbol as its
    leading dimension instead, every other dimension the same."""
    v = node.meta.get("val")
    if not isinstance(v, Tensor) or v.ndim != one.ndim or not isinstance(v.shape[0], torch.SymInt):
        return False
    return all(type(a) is int and a == b for a, b in zip(v.shape[1:], one.shape[1:]))




def _generate(graph: torch.fx.Graph) -> Any:
    """A Python function running ``graph`` (placeholders in, the output node's values out) that
    calls each ATen operation through torch's compiled entry for the operator its schema names
    (made once with the operation's analysis, ``op_entry.call_op``; not ``OpOverload._op``, an
    attribute a forward could replace before the graph is made: hundred-and-second hostile
    review), held in its own namespace: nothing is looked up at run time, so no patch of ``torch.ops``, of
    ``OpOverload.__call__`` or of ``nn.Module.__call__`` (a global module hook on a GraphModule:
    sixty-sixth hostile review, 2.29 C and 1.43 C) reaches the step; no builtins either (the
    namespace's ``__builtins__`` is empty: arithmetic on sizes, indexing and list displays are
    syntax)."""
    names: dict[torch.fx.Node, str] = {}
    space: dict[str, Any] = {"__builtins__": {}}
    lines: list[str] = []
    holders: list[str] = []

    def const(v: Any) -> str:
        if type(v) in (int, bool, type(None)) or (type(v) is float and v == v
                                                  and v not in (float("inf"), float("-inf"))):
            return repr(v)
        key = f"_c{len(space)}"
        space[key] = v
        return key

    def render(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(render(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, dict):
            raise CompiledUnsupported("a dict argument in the graph")
        return const(a)

    for i, n in enumerate(graph.nodes):
        name = names[n] = f"_v{i}"
        if n.op == "placeholder":
            holders.append(name)
        elif n.op == "output":
            lines.append(f"return {render(n.args[0])}")
        elif n.target is operator.getitem:
            lines.append(f"{name} = {render(n.args[0])}[{render(n.args[1])}]")
        elif n.target in _INFIX:
            lines.append(f"{name} = ({render(n.args[0])}) {_INFIX[n.target]} "
                         f"({render(n.args[1])})")
        elif n.target is operator.neg:
            lines.append(f"{name} = -({render(n.args[0])})")
        elif isinstance(n.target, torch._ops.OpOverload):
            fn = f"_f{i}"
            # (the dispatcher's entry found by the schema's name, not the overload's ``_op``
            # attribute, which a forward could have replaced before the graph was made:
            # hundred-and-second hostile review, 8.68 C on every graph step)
            space[fn] = _meta(n.target).op
            args = [render(a) for a in n.args] + [f"{k}={render(v)}" for k, v in n.kwargs.items()]
            lines.append(f"{name} = {fn}({', '.join(args)})")
        else:
            raise CompiledUnsupported(f"the graph calls {n.target}, which is not generated")
    src = f"def _graph({', '.join(holders)}):\n" + "".join(f"    {ln}\n" for ln in lines)
    exec(compile(src, "<dpclip compiled graph>", "exec"), space)  # noqa: S102 - our own source
    return space["_graph"]


class _Spec:
    """One ruled call of the graph: the owner's name, the positions of its input and output
    among the graph's extra outputs, and the analysis's layouts."""

    __slots__ = ("name", "a_at", "out_at", "source_at", "layouts", "group", "expanded",
                 "module", "roles", "config", "slots", "a_node", "call", "scale", "lookup",
                 "through", "ids_node", "ids_at")

    def __init__(self, name: str, module: nn.Module, roles: tuple[str, ...]) -> None:
        self.name = name
        self.module = module
        self.roles = roles
        self.config = _static_config(module)
        self.a_at = self.out_at = self.source_at = -1
        self.layouts: Any = None
        self.group = 1
        self.expanded = False
        self.slots: dict[str, int] = {}  # role -> position of its placeholder
        self.a_node: Any = None  # the graph node of the call's input (the rule's ``a``)
        self.call = ""  # the name of the call's node
        #: ``(role, rule)``: a per-layer module's broadcast use of one parameter
        #: (:class:`_BroadcastRule`), else None
        self.scale: tuple[str, _BroadcastRule] | None = None
        #: the base class (nn.Embedding, nn.LayerNorm) whose rule a subclass's canonical call
        #: takes (:func:`_subclass_of`), else None; e.g. a lookup of an nn.Embedding subclass's
        #: table (:func:`_embedding_subclass`) takes the Embedding rule
        self.lookup: type | None = None
        #: a use of a batch-less lookup's output (:class:`_LookupThrough`), its ids' node and
        #: their position among the graph's extra outputs; else None
        self.through: _LookupThrough | None = None
        self.ids_node: Any = None
        self.ids_at = -1


def _ties(inputs: list[tuple[str, Any]], flat: list[Any]) -> tuple:
    """The graph's parameter inputs grouped by the tensor they get (a tied parameter is one
    tensor at several inputs)."""
    groups: dict[int, list[int]] = {}
    for i, ((kind, _), t) in enumerate(zip(inputs, flat)):
        if kind == "p":
            groups.setdefault(ident(t), []).append(i)
    return tuple(sorted(tuple(g) for g in groups.values()))


def _autocast_on() -> bool:
    """Autocast on any device type (``torch.is_autocast_enabled()`` alone answers for CUDA only:
    CPU bfloat16 autocast went unseen, sixty-sixth hostile review)."""
    for dev in ("cpu", "cuda", "xpu", "mps", "hpu"):
        try:
            if torch.is_autocast_enabled(dev):
                return True
        except (RuntimeError, TypeError, ValueError):  # (a device type this build lacks)
            continue
    return False


class Plan:
    """A proved graph, ready to run on every step (:func:`plan_of`)."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: list[tuple[str, Any]],
                 specs: list[_Spec], model: nn.Module) -> None:
        self.fn = _generate(gm.graph)  # (what every step runs: :func:`_generate`)
        #: ``(kind, target)`` of each placeholder, in order ("p", name) / ("b", name) /
        #: ("c", tensor) / ("x", leaf index)
        self.inputs = inputs
        self.specs = specs
        self.model = weakref.ref(model)
        named = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        now = [named.get(t) if k == "p" else buffers.get(t) if k == "b" else
               t if k == "c" else None for k, t in inputs]
        #: the parameter inputs that share a tensor (checked on every step: :func:`_ties`)
        self.ties = _ties(inputs, now)
        #: ``(position, shape, dtype, device, strides)`` of every parameter, buffer and constant
        #: the analysis ran on: the graph's layouts were proved for these (a buffer of another
        #: rank broadcasts otherwise; sixty-seventh hostile review, 1.87 C)
        self.meta = [(i, t.shape, t.dtype, t.device, t.stride()) for i, t in enumerate(now)
                     if isinstance(t, Tensor)]
        #: the names of the ruled layers when the graph was proved (some may have no call)
        self.owners: set[str] = {sp.name for sp in specs}
        #: whether a step of the traced path ran this graph's program and passed
        #: (ghost_forward._compiled_forward): until then the engine traces
        self.confirmed = False
        #: the constants the graph reads (tensors that are not the model's parameters or buffers:
        #: a module-level tensor the forward reads, a literal it makes), copied when the graph is
        #: adopted (:meth:`confirm`): every step runs on these copies, and a constant that holds
        #: other values now refuses the step (seventy-second hostile review: a finalizer of a
        #: traced step wrote a module-level tensor with one example's data, which the graph read
        #: live on every later step, 5.15 C)
        self.frozen: dict[int, Tensor] = {}
        #: why the graph is not run again (auto: it failed when it ran; the traced path runs)
        self.failed: str | None = None

    def constants(self) -> dict[int, Tensor]:
        """Copies of the constants the graph reads, as they are now (taken right after the first
        chunk of the graph's first step, traced, read them: before anything of that step is
        released, whose finalizers could write them). A constant the traced chunk read from
        outside the call must still hold the values it had when the chunk's loss returned (the
        proved-program match's, ``proved_program._LAST``): written between (user code that ran
        in the backward, a finalizer of a saved tensor the walk let go), the graph would freeze
        one example's data into every later step (hundred-and-twenty-seventh hostile review:
        8.3 C through make_private); refused."""
        frozen = {}
        for i, (kind, t) in enumerate(self.inputs):
            if kind == "c" and isinstance(t, Tensor):
                with _cm.no_grad():
                    frozen[i] = t.detach().clone(memory_format=torch.preserve_format)
                    last = _LAST.get(t)
                    if last is not None and not _equal(frozen[i], last):
                        raise UnsupportedModelError(
                            "a tensor the compiled graph reads as a constant (a module-level "
                            "tensor, a closure's) was written after the traced step's loss "
                            "returned (by a finalizer or other code that ran in the backward or "
                            "the engine's reductions): the graph would read one step's data on "
                            "every later step. Keep such tensors constant, or register them as "
                            "buffers")
        return frozen

    def confirm(self, frozen: dict[int, Tensor]) -> None:
        """Adopt the graph (its first step, traced, passed), with the constants ``frozen`` that
        step read (:meth:`constants`)."""
        self.frozen = frozen
        self.confirmed = True

    def _feed(self, model: nn.Module, xs: Any, ys: Any) -> list[Any]:
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        leaves = pytree.tree_leaves((xs, ys))
        flat: list[Any] = []
        for kind, target in self.inputs:
            if kind == "p":
                t = params.get(target)
                if t is None or type(t) is not nn.Parameter:
                    raise CompiledUnsupported(
                        f"parameter {target!r} is missing or not a plain nn.Parameter")
            elif kind == "b":
                t = buffers.get(target)
                if t is None or type(t) is not Tensor:
                    raise CompiledUnsupported(f"buffer {target!r} is missing or a tensor subclass")
            elif kind == "c":
                t = target
                kept = self.frozen.get(len(flat))
                if kept is not None:
                    with _cm.no_grad():  # (by bits: -0.0 is not 0.0)
                        same = t.stride() == kept.stride() and _equal(t, kept)
                    if not same:
                        raise CompiledUnsupported(
                            "a tensor the graph reads as a constant (not a parameter or buffer: "
                            "a module-level tensor, a closure's) holds other values than when "
                            "the graph was adopted; call dpclip.engine.compiled.reset(model) "
                            "after changing it")
                    t = kept
            else:
                t = leaves[target]
                if type(t) is not Tensor or t.requires_grad:
                    raise CompiledUnsupported(
                        "an input or target is a tensor subclass or requires grad (its "
                        "__torch_function__ or hooks would run user code in the step)")
            flat.append(t)
        return flat

    def run(self, model: nn.Module, scan: Any, xs: Any, ys: Any,
            batch: int) -> tuple[list[_Call], Tensor]:
        """One step's forward: ``(calls, per-example losses)``, no user code run."""
        why = blocked()
        if why is not None:
            raise CompiledUnsupported(f"{why}: user code would run on the graph's operations")
        by_name = {o.name: o for o in scan.owners}
        if set(by_name) != self.owners:
            raise CompiledUnsupported(
                "the model's trainable layers changed since its graph was proved (a parameter's "
                "requires_grad toggled, a layer added); call dpclip.engine.compiled.reset(model)")
        for s in self.specs:
            o = by_name.get(s.name)
            if o is None or o.module is not s.module or type(vars(s.module)) is not dict or \
                    (o.rule is _MODULE) != bool(s.scale or s.lookup) or \
                    (s.lookup and _subclass_of(o) is not s.lookup) or \
                    _static_config(s.module) != s.config:
                raise CompiledUnsupported(
                    f"layer {s.name!r} was replaced or reconfigured since its graph was proved; "
                    "call dpclip.engine.compiled.reset(model) after changing the model")
        flat = self._feed(model, xs, ys)
        for i, shape, dtype, device, stride in self.meta:
            t = flat[i]
            if t.shape != shape or t.dtype != dtype or t.device != device or \
                    t.stride() != stride:
                raise CompiledUnsupported(
                    f"{self.inputs[i][1]!r} changed shape, dtype, device or layout since the "
                    "graph was proved (its layouts hold for the tensors it was proved with); "
                    "call dpclip.engine.compiled.reset(model)")
        if _ties(self.inputs, flat) != self.ties:
            raise CompiledUnsupported(
                "the model's parameters are tied otherwise than when its graph was proved (a "
                "tie made or broken); call dpclip.engine.compiled.reset(model)")
        for s in self.specs:  # the layers' own parameters are what the graph gets
            mp = s.module._parameters
            if any(mp.get(r) is not flat[i] for r, i in s.slots.items()):
                raise CompiledUnsupported(
                    f"the parameters of layer {s.name!r} are not the tensors its graph gets (a "
                    "tie made or broken since the graph was proved); call "
                    "dpclip.engine.compiled.reset(model)")
        with torch.enable_grad():
            outs = self.fn(*flat)
        losses = outs[0]
        calls: list[_Call] = []
        for s in self.specs:
            o = by_name[s.name]
            a, out = outs[s.a_at], outs[s.out_at]
            if s.expanded:
                a = a.expand(batch, *a.shape[1:])
            if s.scale:  # (a per-layer module's parameter in a broadcast use: its own call)
                role, rule = s.scale
                o = _Owner(o.name, o.module, rule, (role,),
                           (o.pnames[o.roles.index(role)],))
            elif s.lookup:  # (an nn.Embedding or nn.LayerNorm subclass's call: its base's rule)
                o = _Owner(o.name, o.module, _RULES[s.lookup], o.roles, o.pnames)
            elif s.through:  # (a use of a batch-less lookup's output: _LookupThrough)
                o = _Owner(o.name, o.module, s.through, o.roles, o.pnames)
            c = _Call(o, a, out, None)
            if s.through:
                c.args = outs[s.ids_at]
            c.layouts = s.layouts
            c.group = s.group
            if s.expanded:
                c.source = outs[s.source_at].grad_fn
            calls.append(c)
        # as after a traced call: this batch's tensors are a past batch's data in later traces
        tracer = SeparabilityTracer(batch)
        for t in batch_leaves(xs, "inputs") + batch_leaves(ys, "targets"):
            tracer.mark(t, (0, 1))
        fed = {id(t) for t in flat}
        for t in outs:  # (what the graph computed: a parameter, buffer or constant it returns, as
            # a batch-less layer's input, stays what it is: marked, every later trace read it as
            # a past batch's data and refused the model)
            if isinstance(t, Tensor) and id(t) not in fed:
                tracer.mark(t, (0, 1))
        tracer.retire()
        return calls, losses


#: the plans (or the reason a graph is refused) by exported program
_PLANS: "weakref.WeakKeyDictionary[Any, Plan | str]" = weakref.WeakKeyDictionary()


def reset(model: nn.Module | None = None) -> None:
    """Forget the proved graphs (of every model): the next compiled step exports and proves the
    model's program again (after changing Python state the proof's key does not see)."""
    from dpclip.engine import batch_symbol

    _PLANS.clear()
    if model is None:
        batch_symbol._CACHE.clear()
        batch_symbol._CALLABLES.clear()
    else:
        got = batch_symbol._CACHE.get(model)
        if got is not None:
            got.clear()


#: in-place operations the analysis writes out of place (:func:`_out_of_place`): their functional
#: twin, and whether its result has the written tensor's dtype whatever the other operands'
#: ("self": fills) or only when every tensor operand has it ("promote": arithmetic, where the
#: in-place form casts the promoted result back); not ``copy_`` (its twin has no derivative)
_OUT_OF_PLACE: dict[str, str] = {
    "add_": "promote", "sub_": "promote", "mul_": "promote", "div_": "promote",
    "neg_": "promote", "clamp_": "promote", "clamp_min_": "promote", "clamp_max_": "promote",
    "relu_": "promote", "tanh_": "promote", "sigmoid_": "promote", "exp_": "promote",
    "pow_": "promote", "sqrt_": "promote", "rsqrt_": "promote", "addcmul_": "promote",
    "addcdiv_": "promote", "hardtanh_": "promote", "leaky_relu_": "promote",
    "threshold_": "promote", "masked_fill_": "self", "fill_": "self", "zero_": "self",
}


def _alias_roots(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each node's alias class (union-find root): a node whose operation's schema annotates a
    return (views, ``detach``, in-place results, lists of views) is joined to every annotated
    argument, the items of a returned list through ``getitem``, and ``_unsafe_view`` to its input
    (memory shared, unannotated); nodes of other kinds stand alone."""
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def root(n: torch.fx.Node) -> torch.fx.Node:
        while parent.setdefault(n, n) is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def join(a: torch.fx.Node, b: torch.fx.Node) -> None:
        ra, rb = root(a), root(b)
        if ra is not rb:
            parent[ra] = rb

    for n in graph.nodes:
        root(n)
        if n.op != "call_function":
            continue
        t = n.target
        if t is operator.getitem and n.args and isinstance(n.args[0], torch.fx.Node):
            join(n, n.args[0])
            continue
        if not isinstance(t, torch._ops.OpOverload):
            continue
        if t.overloadpacket is _aten._unsafe_view and isinstance(n.args[0], torch.fx.Node):
            join(n, n.args[0])  # (shares its input's memory; its schema does not say so)
            continue
        # any annotated return (a view, an in-place result, a list of views whose sets sit on
        # the element type and read empty here: split, tensor_split, unbind) joins every
        # annotated argument: over-joining only refuses more (seventy-eighth hostile review:
        # tensor_split's pieces were not seen, the graph step's gradients were another program's)
        if not any(r.alias_info is not None for r in t._schema.returns):
            continue
        for arg, val in zip(t._schema.arguments, list(n.args) + [None] * len(t._schema.arguments)):
            if arg.alias_info is not None:
                val = n.kwargs.get(arg.name, val) if arg.kwarg_only else val
                for v in (val if isinstance(val, (list, tuple)) else (val,)):
                    if isinstance(v, torch.fx.Node):
                        join(n, v)
    return {n: root(n) for n in graph.nodes}


def _out_of_place(graph: torch.fx.Graph) -> None:
    """Rewrite each in-place operation on a tensor the graph made (``h += residual``: ResNet, T5,
    MPNet, Falcon) as its functional twin, the later readers of the tensor reading the twin's
    result: the same program, out of place (the analysis and :meth:`Plan.run` then see no write).

    Done only where nothing could tell the difference, else the write is left for the refusal that
    follows: the written tensor is the operation's first argument and the only one written, the
    twin is in :data:`_OUT_OF_PLACE` with the same arguments, the result's dtype is the written
    tensor's (no promotion: ``"promote"`` operations need every tensor operand of that dtype), and
    after the write no other alias of the written tensor is read (a view taken before the write, or
    the tensor a view was taken from, would see the write: the rewrite would change what it reads)
    and no alias is an input of the graph (a write to a parameter, buffer or the batch). Shapes need
    no check: an in-place operation that ran has the written tensor's shape as its broadcast shape,
    which the twin then has."""
    while True:
        order = {n: i for i, n in enumerate(graph.nodes)}
        for m in graph.nodes:
            t = m.target
            if m.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or \
                    not t._schema.is_mutable:
                continue
            if t is _aten.detach_.default:
                continue  # (autograd metadata, checked by the caller)
            twin = _twin(m)
            if twin is None:
                return  # (refused by the caller, with the operation named)
            x = m.args[0]
            before, after = order[m], [u for u in x.users if order[u] > order[m]]
            with graph.inserting_before(m):
                z = graph.call_function(twin, tuple(m.args), dict(m.kwargs))
            z.meta = dict(m.meta)
            m.replace_all_uses_with(z)
            for u in after:
                u.replace_input_with(x, z)
            graph.erase_node(m)
            # the written tensor's class, with the twin's readers moved off it: any other member
            # read after the write (or an input of the graph) would have seen the write
            cls = _alias_class(graph, x)
            late = [v for v in cls if v is not x and any(
                order.get(u, before + 1) > before for u in v.users)]
            if any(v.op == "placeholder" for v in cls) or late:
                raise CompiledUnsupported(
                    f"the graph writes in place ({t}) to a tensor "
                    + ("of the graph's inputs" if any(v.op == "placeholder" for v in cls) else
                       f"whose alias {late[0].name!r} is read after the write")
                    + "; the compiled path runs out-of-place programs")
            break
        else:
            return


def _alias_class(graph: torch.fx.Graph, x: torch.fx.Node) -> list[torch.fx.Node]:
    """Every node of ``x``'s alias class (:func:`_alias_roots`), ``x`` included."""
    roots = _alias_roots(graph)
    return [n for n, r in roots.items() if r is roots[x]]


_INTS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _twin(m: torch.fx.Node) -> Any:
    """The functional twin of in-place node ``m`` (:func:`_out_of_place`), or None."""
    t = m.target
    name = t._schema.name.split("::")[-1]
    kind = _OUT_OF_PLACE.get(name)
    if kind is None or t.namespace != "aten" or not m.args or \
            not isinstance(m.args[0], torch.fx.Node):
        return None
    args = t._schema.arguments
    written = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
    if len(written) != 1 or written[0] is not args[0]:
        return None
    packet = getattr(_aten, name[:-1], None)
    twin = getattr(packet, t._overloadname, None) if packet is not None else None
    if not isinstance(twin, torch._ops.OpOverload) or twin._schema.is_mutable or \
            [a.name for a in twin._schema.arguments] != [a.name for a in args]:
        return None
    val = m.args[0].meta.get("val")
    if not isinstance(val, Tensor) or not (val.is_floating_point() or val.dtype in _INTS):
        return None
    if kind == "promote":
        operands = pytree.tree_leaves((m.args[1:], m.kwargs))
        for v in operands:
            if isinstance(v, torch.fx.Node):
                ov = v.meta.get("val")
                if not isinstance(ov, Tensor) or ov.dtype != val.dtype:
                    return None
            elif isinstance(v, bool) or (isinstance(v, float) and not val.is_floating_point()):
                return None
    return twin


def plan_of(program: Any, model: nn.Module, scan: Any, xs: Any, ys: Any) -> Plan:
    """The :class:`Plan` of a proof's graph (analysed on first use, cached with the graph);
    raises :class:`CompiledUnsupported` with the reason it cannot be proved."""
    exported = getattr(program, "exported", None)
    if exported is None:
        raise CompiledUnsupported("the batch-size proof kept no graph")
    ep = exported[0]
    got = _PLANS.get(ep)
    if got is None:
        try:
            got = _analyse(exported, model, scan, xs, ys)
        except CompiledUnsupported as exc:
            got = str(exc)
        _PLANS[ep] = got
    if isinstance(got, str):
        raise CompiledUnsupported(got)
    if got.model() is not model:
        raise CompiledUnsupported("the graph was proved for another model object")
    return got


def _analyse(exported: tuple, model: nn.Module, scan: Any, xs: Any, ys: Any) -> Plan:
    ep, uniform, wrapped = exported
    if wrapped:
        raise CompiledUnsupported(
            "the forward has grad-mode or autocast regions (torch.no_grad(), autocast), which "
            "the exported graph keeps as wrappers; the compiled path does not run them yet")
    sig = ep.graph_signature
    outs = list(sig.output_specs)
    if len(outs) != 1 or outs[0].kind.name != "USER_OUTPUT":
        raise CompiledUnsupported(
            "the forward or loss writes a buffer or an input in place (or returns more than the "
            "losses): a write to the model's state from the batch")
    gm = torch.fx.GraphModule(ep.graph_module, ep.graph_module.graph.__deepcopy__())
    graph = gm.graph
    _out_of_place(graph)  # (writes to the graph's own tensors, where nothing can tell)
    holders = [n for n in graph.nodes if n.op == "placeholder"]
    specs_in = list(sig.input_specs)
    if len(holders) != len(specs_in):
        raise CompiledUnsupported("the graph's inputs do not match its signature")
    leaves = pytree.tree_leaves((xs, ys))
    inputs: list[tuple[str, Any]] = []
    by_param: dict[str, torch.fx.Node] = {}
    by_buffer: dict[str, torch.fx.Node] = {}
    n_user = 0
    for n, s in zip(holders, specs_in):
        kind = s.kind.name
        target = s.target[len("model."):] if isinstance(s.target, str) and \
            s.target.startswith("model.") else s.target
        if kind == "PARAMETER":
            inputs.append(("p", target))
            by_param[target] = n
        elif kind == "BUFFER":
            inputs.append(("b", target))
            by_buffer[target] = n
        elif kind == "CONSTANT_TENSOR":
            if not _literal(model, target):
                raise CompiledUnsupported(
                    f"the forward reads the tensor attribute {target!r}, which is neither a "
                    "parameter nor a buffer; register it as a buffer")
            c = ep.constants.get(s.target)
            if type(c) is not Tensor:
                raise CompiledUnsupported(f"constant {s.target!r} is not a plain tensor")
            inputs.append(("c", c))
        elif kind == "USER_INPUT":
            if n_user >= len(leaves) or not isinstance(leaves[n_user], Tensor):
                raise CompiledUnsupported("a non-tensor input or target is part of the graph")
            inputs.append(("x", n_user))
            n_user += 1
        else:
            raise CompiledUnsupported(f"the graph has an input of kind {kind}")
    if n_user != len(leaves):
        raise CompiledUnsupported("the graph's inputs are not the step's inputs and targets")
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op != "call_function":
            raise CompiledUnsupported(f"the graph has a {n.op} node ({n.target})")
        t = n.target
        if t in _SYM_OPS:
            continue
        if not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten":
            raise CompiledUnsupported(f"the graph calls {t}, which is not an ATen operation")
        if t is _aten.detach_.default and isinstance(n.args[0], torch.fx.Node) and \
                n.args[0].op != "placeholder":
            continue  # (autograd metadata of a tensor the graph made; no value written)
        if t._schema.is_mutable or any(r.alias_info is not None and r.alias_info.is_write
                                       for r in t._schema.returns):
            raise CompiledUnsupported(
                f"the graph writes in place ({t}); the compiled path runs out-of-place programs")
        if t.overloadpacket in _UNINIT:
            raise CompiledUnsupported(f"the graph reads uninitialised memory ({t})")

    # the ruled layers' calls: their canonical operations with their own parameters; every use
    # of a trainable parameter is such a call (a tied parameter: the calls of every holder)
    named = dict(model.named_parameters(remove_duplicate=False))
    by_ident: dict[int, torch.fx.Node] = {}
    for target, node in by_param.items():
        t = named.get(target)
        if t is None:
            raise CompiledUnsupported(f"parameter {target!r} of the graph is not the model's")
        held = by_ident.get(ident(t))
        if held is not None and held.users and node.users:
            raise CompiledUnsupported(f"parameter {target!r} is two inputs of the graph")
        if held is None or not held.users:  # (a tied parameter: the input the graph uses)
            by_ident[ident(t)] = node
    slot = {h.name: i for i, h in enumerate(holders)}
    specs: list[_Spec] = []
    extra: list[torch.fx.Node] = []
    ruled: dict[str, _Spec] = {}  # call node name -> spec
    # owner name -> (owner, its placeholders, Conv1D?, the base class a subclass is read as)
    holders_of: dict[str, tuple] = {}
    expansions: dict[str, _Spec] = {}  # name of an expansion node -> spec
    covered: set[str] = set()  # the users of broadcast-used parameters (_broadcast_uses)
    for o in scan.owners:
        if o.rule is _MODULE or o.rule.kind == "module":
            nodes = {r: by_ident.get(ident(o.module._parameters.get(r))) for r in o.roles}
            uses = _broadcast_uses(o, nodes) if all(nodes.values()) else None
            if uses is not None:  # (broadcast uses of its parameters: _BroadcastRule)
                for role, call, a, rule in uses:
                    _claim(o, (role,), {role: nodes[role]}, slot, call, a, specs, ruled,
                           expansions, extra)
                    specs[-1].scale = (role, rule)
                    # (every user of the parameter is a use, a chain step or an assertion:
                    # _broadcast_uses checked them all)
                    covered.update(u.name for u in nodes[role].users)
                holders_of[o.name] = (o, nodes, False, None)
                continue
            base = _subclass_of(o)
            node = nodes.get("weight")
            if base is not None and node is not None and node.users and all(nodes.values()):
                # (an nn.Embedding or nn.LayerNorm subclass: its canonical calls take the base
                # class's rule, the forward around them is graph code like any other; any other
                # use of its parameters must be another ruled layer's call, a tied output
                # projection, or the check of stray uses below refuses it)
                ph = dict(nodes)
                for call in list(node.users):
                    if call.name in ruled:
                        continue
                    why, a = _canonical(call, o.module, ph, gm, as_cls=base)
                    if why is not None and base is nn.Linear:  # (x @ W.T [+ b])
                        got = _matmul_call(call, o.module, ph)
                        if got is not None:
                            covered.add(call.name)  # (the transpose: read by the call only)
                            (call, a), why = got, None
                    if why is None:
                        _claim(o, o.roles, ph, slot, call, a, specs, ruled, expansions, extra)
                        specs[-1].lookup = base
                holders_of[o.name] = (o, ph, False, base)
                continue
            raise CompiledUnsupported(
                f"layer {o.name!r} ({type(o.module).__name__}) needs the per-layer path, which "
                "the compiled engine does not run yet; use engine 'ghost'")
        conv1d = o.rule is _CONV1D and type(o.module).__name__ == "Conv1D"
        if type(o.module) not in _CANON and not conv1d:
            raise CompiledUnsupported(
                f"layer {o.name!r} ({type(o.module).__name__}) has no compiled rule yet (only "
                f"{', '.join(sorted(c.__name__ for c in _CANON))} and transformers Conv1D); "
                "use engine 'ghost'")
        roles = tuple(r for r in ("weight", "bias") if o.module._parameters.get(r) is not None)
        ph: dict[str, torch.fx.Node] = {}
        for r in roles:
            node = by_ident.get(ident(o.module._parameters[r]))
            if node is None:
                raise CompiledUnsupported(
                    f"the {r} of layer {o.name!r} is not an input of the graph")
            ph[r] = node
        if isinstance(o.module, _BATCHNORMS):
            for b in ("running_mean", "running_var"):
                node = by_buffer.get(_fqn(o.name, b))
                if node is not None:
                    ph[b] = node
        # every call of the layer through its canonical operation (a layer called twice, a
        # shared embedding: two calls, the reduction's rule for several uses of a parameter);
        # any other use of its parameters is refused below
        found = [(u, a) for u in ph[roles[0]].users if u.name not in ruled
                 for why, a in [_canonical(u, o.module, ph, gm, conv1d)] if why is None]
        for call, a in found:
            uses = _lookup_uses(o.module, call, a)
            if uses is not None:  # (a batch-less lookup used through broadcasts: _LookupThrough)
                for i, (use, x, rule) in enumerate(uses):
                    _claim(o, roles, ph, slot, use, x, specs, ruled, expansions, extra)
                    spec = specs[-1]
                    spec.through, spec.ids_node = _LookupThrough(rule, i == 0), a
                    extra.append(a)
                    spec.ids_at = len(extra)
                covered.add(call.name)
                continue
            _claim(o, roles, ph, slot, call, a, specs, ruled, expansions, extra)
        holders_of[o.name] = (o, ph, conv1d, None)
    for target, node in by_param.items():
        if ident(named[target]) not in scan.by_param:  # (frozen: a constant of the graph)
            continue
        stray = [u for u in node.users if u.name not in ruled and u.name not in covered]
        if stray:
            whys = [_canonical(stray[0], o.module, ph, gm, c1, as_cls=base)[0]
                    for o, ph, c1, base in holders_of.values() if node in ph.values()]
            raise CompiledUnsupported(
                f"parameter {target!r} is used outside its layer's call (by "
                f"{getattr(stray[0].target, '__name__', stray[0].target)}"
                + (f": {whys[0]}" if whys and whys[0] else "")
                + "); the per-layer rules cannot see that use")
    # every trainable parameter is some ruled layer's (the scan refuses others)
    owned = {_fqn(o.name, r) for o in scan.owners for r in o.module._parameters}
    stray = [p for p in scan.params if p not in owned]
    if stray:
        raise CompiledUnsupported(f"parameter(s) {', '.join(stray)} belong to no ruled layer")

    out_node = next(n for n in graph.nodes if n.op == "output")
    loss_node = out_node.args[0][0] if isinstance(out_node.args[0], (tuple, list)) \
        else out_node.args[0]
    batch_expr = None
    for n in holders:
        if inputs[holders.index(n)][0] == "x":
            v = n.meta.get("val")
            if isinstance(v, Tensor) and v.ndim and isinstance(v.shape[0], torch.SymInt):
                batch_expr = v.shape[0].node.expr
                break
    if batch_expr is None:
        raise CompiledUnsupported("the graph has no symbolic batch dimension")
    iota = _iota_dims(gm, batch_expr)
    primes = _prime_batches(gm, [tuple(t.shape[1:]) for t in leaves])
    with defaults_unchanged():  # (its dropout draws do not advance the step's generators)
        results = [_separable(gm, inputs, holders, model, leaves, p, ruled, expansions,
                              uniform, iota, loss_node) for p in primes]
    if results[0] != results[1]:
        raise CompiledUnsupported("the analysis gives different layouts at two batch sizes")
    for spec in specs:  # (by the call each spec reads, never by position)
        spec.layouts, spec.group = results[0][spec.call]

    out_node.args = ((loss_node, *extra),)
    gm.recompile()
    plan = Plan(gm, inputs, specs, model)
    plan.owners = {o.name for o in scan.owners}
    return plan


def _separable(gm: torch.fx.GraphModule, inputs: list, holders: list, model: nn.Module,
               leaves: list, batch: int, ruled: dict, expansions: dict, uniform: frozenset,
               iota: dict, loss_node: Any) -> dict[str, tuple[Any, int]]:
    """The separability analysis of the graph on public zeros at ``batch``: each ruled call's
    ``(layouts, group)`` by the name of its node; raises :class:`CompiledUnsupported`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    flat: list[Any] = []
    for kind, target in inputs:
        if kind == "p":
            flat.append(params[target])
        elif kind == "b":
            flat.append(buffers[target])
        elif kind == "c":
            flat.append(target)
        else:
            t = leaves[target]
            flat.append(torch.zeros((batch, *t.shape[1:]), dtype=t.dtype, device=t.device))
    tracer = SeparabilityTracer(batch)
    uni_ids: set[int] = set()
    iota_ids: dict[int, int] = {}
    tracer.structural = (uni_ids, iota_ids)
    found: dict[str, tuple[Any, int]] = {}
    user_holders = {h.name for h, (k, _) in zip(holders, inputs) if k == "x"}

    class _Run(torch.fx.Interpreter):
        def run(self, *args: Any, **kwargs: Any) -> Any:  # (Interpreter.run starts a tqdm bar)
            self.args_iter = iter(args)
            for node in self.graph.nodes:
                self.env[node] = self.run_node(node)
                if node.op == "output":
                    return self.env[node]
            return None

        def run_node(self, n: torch.fx.Node) -> Any:
            v = super().run_node(n)
            quiet, tracer.quiet = tracer.quiet, True
            try:
                if n.op == "placeholder" and n.name in user_holders:
                    tracer.mark(v, (0, 1))
                if isinstance(v, Tensor):
                    if n.name in uniform:
                        uni_ids.add(ident(v))
                    if n.name in iota:
                        iota_ids[ident(v)] = iota[n.name]
                spec = ruled.get(n.name)
                if spec is not None and spec.through is not None and \
                        tracer.layout(self.env[spec.ids_node]) is not None:
                    raise CompiledUnsupported(
                        f"the ids of layer {spec.name!r}'s batch-less lookup depend on the batch")
                if spec is not None and not spec.expanded:
                    a = v if spec.a_node is n else self.env[spec.a_node]
                    lay_a = tracer.layout(a)
                    lay_out = REWRITTEN if tracer.rewritten_to_mix(v) else tracer.layout(v)
                    k = _row_group(lay_a)
                    found[spec.call] = _judge(spec, a, lay_a, lay_out, k, batch, tracer)
                    if (spec.scale or spec.through) and lay_out is not None and \
                            lay_out != (0, k):
                        # (a broadcast use's result is marked as rows of examples below: it
                        # must be so already, not only its judged operand: where(cond, q,
                        # other) with another operand that mixes the examples)
                        raise CompiledUnsupported(
                            f"the result of a broadcast use of layer {spec.name!r} mixes the "
                            f"examples (layout {lay_out!r})")
                    if (spec.scale or spec.through) and lay_out is None and \
                            isinstance(v, Tensor) and v.ndim and v.shape[0] >= batch and \
                            v.shape[0] % batch == 0 and v.stride(0) != 0 and \
                            ident(v) not in tracer.structural[0]:  # type: ignore[index]
                        # (a constant result with a row per example is marked as the examples'
                        # rows below: it must be the same for every example, as a constant
                        # input must (_judge); where(constant cond, q, a constant that depends
                        # on the position in the batch), hostile review 187's hardening)
                        raise CompiledUnsupported(
                            f"the result of a broadcast use of layer {spec.name!r} is a "
                            "constant with one row per example that the graph does not make "
                            "the same for every example")
                    tracer.mark(v, (0, k) if k > 1 and v.ndim and a.ndim and
                                v.shape[0] == a.shape[0] else (0, 1))
                spec = expansions.get(n.name)
                if spec is not None:
                    lay = tracer.layout(v)
                    if lay != (0, 1):
                        raise CompiledUnsupported(
                            f"the expansion of layer {spec.name!r}'s batch-less call is not "
                            "example rows")
                    found[spec.call] = ((None, lay), 1)
                    tracer.mark(v, (0, 1))
            finally:
                tracer.quiet = quiet
            return v

    try:
        with torch.enable_grad(), tracer:
            # (every value kept until the end: the structural sets hold ids, which a freed
            # tensor's successor could otherwise take)
            out = _Run(gm, garbage_collect_values=False).run(*flat)
    except CompiledUnsupported:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever fails on public zeros is "not proven"
        raise CompiledUnsupported(
            f"not proven: the graph failed on public zeros ({type(exc).__name__})") from None
    finally:
        tracer.retire()
    losses = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(losses, Tensor) or losses.ndim == 0 or losses.shape[0] != batch:
        from dpclip.engine.errors import loss_shape_error

        raise loss_shape_error(losses.ndim if isinstance(losses, Tensor) else 0)
    if tracer.violation is not None:
        raise CompiledUnsupported(f"the graph is not per-example separable: {tracer.violation}")
    lay = tracer.layout(losses)
    if lay != (0, 1):
        first = f" (first mixing operation: {tracer.mixers[0]})" if tracer.mixers else ""
        raise CompiledUnsupported(
            f"the per-example losses are not per-example separable (layout {lay!r}){first}")
    missing = [s.name for s in ruled.values() if s.call not in found]
    if missing:
        raise CompiledUnsupported(f"layer {missing[0]!r} was not reached in the analysis")
    return found


def _judge(spec: _Spec, a: Tensor, lay_a: Any, lay_out: Any, k: int, batch: int,
           tracer: SeparabilityTracer) -> tuple[Any, int]:
    """A ruled call's layouts as :func:`~dpclip.engine.ghost_forward._check_separable` accepts
    them (batch first; a constant input with rows per example only when the graph makes it the
    same for every example), else :class:`CompiledUnsupported`."""
    if lay_out == REWRITTEN:
        raise CompiledUnsupported(f"the output of layer {spec.name!r} is rewritten to mix")
    if isinstance(lay_a, tuple) and lay_a[0] == 0:
        return (lay_a, lay_out), lay_a[1]
    if lay_a is None:
        if a.ndim and a.shape[0] >= batch and a.shape[0] % batch == 0 and \
                a.stride(0) != 0 and ident(a) not in tracer.structural[0]:  # type: ignore[index]
            raise CompiledUnsupported(
                f"the input of layer {spec.name!r} is a constant with one row per example that "
                "the graph does not make the same for every example")
        return (lay_a, lay_out), k
    first = f" (first mixing operation: {tracer.mixers[0]})" if tracer.mixers else ""
    raise CompiledUnsupported(
        f"the input of layer {spec.name!r} mixes the examples or has the batch in another "
        f"dimension than 0 (layout {lay_a!r}){first}")
