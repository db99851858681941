"""The batch size is private data: a proof, with a symbolic batch dimension, that a forward pass and
its loss use the batch size only as the leading dimension of example data.

The realised batch size of Poisson sampling is a private quantity (it changes by one when one
example is added or removed). :class:`~dpclip.engine.separable.SeparabilityTracer` runs on the real
batch and sees every ATen operation, but a Python ``int`` taken from ``len(y)``, ``x.size(0)`` or
``x.shape[0]`` reaches those operations as a plain number (``o / 16``) and cannot be told from a
public constant. This module traces ``loss_fn(model(xs), ys)`` once more with
:func:`torch.export.export` (non-strict, the ``make_fx`` machinery) on fake tensors whose first
dimension is ONE symbol ``B``, every other dimension static; every use of ``B`` is then visible:

* a use that turns ``B`` into a Python value (``len(y)``, ``int(x.shape[0])``, ``range(B)``, a branch
  ``if x.shape[0] > k``, a ``% 2``) makes the symbol specialise or adds a guard: export fails with a
  constraint violation, and the verdict is "uses the batch size as a value";
* ``B`` as a symbolic value in the graph (``o / x.shape[0]``, ``full((d,), B)``, ``x[B - 1]``) is
  allowed only as a size: in the size list of a view, reshape, expand or factory, as the end of
  ``arange`` or the bounds of a ``slice``; any other use is refused;
* example data has ``B`` once in its shape (``(B, ...)``, ``(B * T, d)``, ``(T, B, d)``): data copied
  along another dimension of size ``B`` (``x[:, None].expand(-1, B, -1)``, a broadcast against a
  ``(1, B, 1)`` constant) is refused, since a product or scan along the copies makes ``B`` a value
  (``(-1) ** B``) that the row-separable layout of the copies does not show;
* a constant whose shape involves ``B`` (``arange(B)``, ``ones(B)``, ``pe[:B]``) may only be reshaped,
  combined elementwise with ``B``-free constants, drawn from at random, or combined with example data
  (the real-batch tracer then requires it to be the same for every example, a fresh i.i.d. draw, or
  ``arange(B)`` used as the identity index); a reduction or any other operation on it
  (``ones(B).sum()`` is ``B``) is refused, and so is cutting it to a shape without ``B`` (a slice
  or view of ``zeros(8, B)`` flattened, or a ``(1, 1)`` slice read with ``as_strided``: which
  elements remain depends on ``B`` once ``B`` is folded with another dimension);
* whatever cannot be traced on fake tensors (``.numpy()``, ``.tolist()``, ``.item()`` on data,
  data-dependent Python control flow) is "not proven".

Soundness argument: after this check, ``B`` reaches the computation only through the shapes of
tensors; the values of constants shaped by ``B`` are functions of the position alone (``arange``,
slices of ``B``-free tensors, fills with ``B``-free values), never of ``B`` itself; the real-batch
tracer refuses position-dependent constants met with example data. So each example's loss depends
on its own example and public constants only.

Cost and cache: one export per (model, loss function, input signature without the batch size,
module types and training flags), about 0.2 s for a small network and 1-2 s for a tiny Hugging Face
model on a CPU; the verdict holds for every batch size (the symbol stands for all of them), so the
cache key does not contain the batch size. What the cache cannot see: a model whose Python code
changes what it computes between calls with the same signature (a counter in a Python attribute);
the real-batch tracer still checks every call's operations, and Python escapes on every call.
"""

from __future__ import annotations

import collections
from dpclip.engine import _cm
import functools
import operator
import re
import types
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from dpclip._ident import ident
from dpclip.engine.batch import call_model
from dpclip.engine.generators import defaults_unchanged
from dpclip.engine.op_entry import proof_export
from dpclip.engine.past_batches import past_batches_hidden
from dpclip.engine.proved_program import ProgramRecorder, ProvedProgram
from dpclip.engine.recurrent import proof_kernels
from dpclip.engine.views import view_inner

__all__ = ["batch_size_uses", "data_independent_paths", "proof_of"]

_aten = torch.ops.aten

#: ops that take the batch size in a size list (``view(x, [B, -1])``, ``zeros([B, d])``)
_SIZE_LIST_OPS = {
    _aten.view, _aten.reshape, _aten._unsafe_view, _aten.expand, _aten.zeros, _aten.ones,
    _aten.empty, _aten.full, _aten.new_zeros, _aten.new_ones, _aten.new_empty, _aten.new_full,
    _aten.rand, _aten.randn, _aten.randint, _aten.repeat, _aten.unflatten, _aten.split_with_sizes,
    _aten.split, _aten.empty_strided, _aten.new_empty_strided, _aten.view_copy, _aten.expand_copy,
}
#: the elementwise overloads of ``where`` (only ``where.self`` is tagged pointwise)
_WHERE = frozenset({_aten.where.self, _aten.where.ScalarOther, _aten.where.ScalarSelf,
                    _aten.where.Scalar})

#: (op, positions) where a scalar argument may be the batch size: arange's end, slice bounds
_SIZE_SCALAR_ARGS: dict[Any, tuple[int, ...]] = {
    _aten.arange.default: (0,), _aten.arange.start: (1,), _aten.slice.Tensor: (3,),
    _aten.narrow.default: (3,),
}
#: ops that move or copy a tensor's elements without computing from them
_MOVES = {
    _aten.view, _aten.reshape, _aten._unsafe_view, _aten.expand, _aten.unsqueeze, _aten.squeeze,
    _aten.permute, _aten.transpose, _aten.t, _aten.clone, _aten.contiguous, _aten._to_copy,
    _aten.to, _aten.detach, _aten.alias, _aten.slice, _aten.lift_fresh_copy, _aten.flatten,
    _aten.unflatten, _aten.type_as, _aten.view_copy, _aten.expand_copy,
}
#: ops that read only the shape, dtype and device of their tensor argument
_SHAPE_ONLY = {
    _aten.sym_size, _aten.sym_numel, _aten.sym_stride, _aten.empty_like, _aten.zeros_like,
    _aten.ones_like, _aten.full_like, _aten.rand_like, _aten.randn_like, _aten.randint_like,
    _aten.new_zeros, _aten.new_ones, _aten.new_empty, _aten.new_full, _aten.new_empty_strided,
}
if hasattr(_aten, "_assert_tensor_metadata"):  # export's check of a .to(dtype, device): no output
    _SHAPE_ONLY.add(_aten._assert_tensor_metadata)
#: random draws (elementwise i.i.d. given scalar parameters) that may be shaped by the batch
_RANDOM = {_aten.bernoulli, _aten.rand_like, _aten.randn_like, _aten.dropout,
           _aten.native_dropout, _aten.randint_like, _aten.uniform, _aten.normal,
           _aten.bernoulli_, _aten.uniform_, _aten.normal_, _aten.exponential_, _aten.random_,
           # fills with a B-free value (a symbolic value is refused as an argument above)
           _aten.fill_, _aten.zero_, _aten.fill}


#: ops through which a constant shaped by the batch size may meet example data: each output
#: element reads the constant at its own position (or the constant indexes / masks / is moved),
#: so the real-batch trace's position rules judge it; a contraction (mm, bmm, einsum, a
#: reduction) could instead sum the constant over the batch into a value that carries ``B``
_POSITIONWISE_WITH_DATA = {
    _aten.cat, _aten.stack, _aten.index, _aten.index_select, _aten.gather, _aten.index_put,
    _aten.index_put_, _aten.embedding, _aten.masked_fill, _aten.masked_fill_, _aten.copy_,
    _aten.scaled_dot_product_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_efficient_attention, _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_cudnn_attention, _aten._safe_softmax,
    # row n of the output from row n of every argument (an image sampled at its own grid, a plane
    # scattered by its own indices, the distances between the rows' own point sets)
    _aten.grid_sampler, _aten.grid_sampler_2d, _aten.grid_sampler_3d, _aten.max_unpool2d,
    _aten.max_unpool3d, _aten._cdist_forward, _aten.cdist,
}


def _combines_positionwise(target: Any, packet: Any, node: Any = None) -> bool:
    """Whether ``target`` may combine example data with a constant shaped by the batch size."""
    return (packet in _POSITIONWISE_WITH_DATA or packet in _MOVES or packet in _RANDOM
            or target in _WHERE or target is operator.getitem
            or _pointwise(target)
            or (packet in _BATCHED_MATMUL and node is not None and _matmul_batch_only(node))
            or (target in _RNN_INPUT and node is not None and _rnn_states_only(node)))


#: the recurrent operations as nn.LSTM / nn.GRU / nn.RNN call them (dpclip.engine.recurrent)
_RNN_INPUT = {_aten.lstm.input, _aten.gru.input, _aten.rnn_tanh.input, _aten.rnn_relu.input}


def _rnn_states_only(node: Any) -> bool:
    """A recurrent operation whose constants shaped by the batch size are its initial states
    alone, each ``(layers, B, h)`` with the batch symbol in dimension 1 only, its weights free of
    it. The states' column ``n`` starts example ``n``'s recurrence (the operation is per example
    along its batch dimension; nothing is contracted or reduced along it), so the constant meets
    the examples position by position, as in an elementwise product; the real-batch tracer then
    requires it to be the same for every example (``separable._fused_rnn``): ``zeros``, as
    ``nn.LSTM`` makes it when no state is given."""
    if len(node.args) != 9 or not isinstance(node.args[2], (list, tuple)):
        return False
    if any(_has_sym_shape(a.meta.get("val")) for a in _flat_nodes(node.args[2])):
        return False
    for a in _flat_nodes(node.args[1]):
        v = a.meta.get("val")
        if not isinstance(v, Tensor) or v.dim() != 3:
            return False
        if any(isinstance(d, torch.SymInt) and d.node.expr.free_symbols
               for i, d in enumerate(v.shape) if i != 1):
            return False
    return True


#: matrix products whose leading dimensions are batch dimensions, broadcast elementwise
_BATCHED_MATMUL = {_aten.matmul, _aten.bmm}


def _matmul_batch_only(node: Any) -> bool:
    """A matrix product whose operands have the batch symbol in their leading (batch) dimensions
    only: ``out[..., i, j] = sum_k a[..., i, k] b[..., k, j]`` combines the operands position by
    position along the leading dimensions and contracts only the last two, so a constant shaped
    ``(B, n, k)`` meets example data ``(B, k, m)`` row by row (transformers < 5.18's rotary
    embedding: ``inv_freq[None, :, None].expand(B, -1, 1) @ position_ids[:, None, :]``). The
    constant's rows are then held to the same rules as for an elementwise product (the real-batch
    tracer)."""
    vals = [a.meta.get("val") for a in node.args[:2] if isinstance(a, torch.fx.Node)]
    if len(vals) != 2 or not all(isinstance(v, Tensor) for v in vals):
        return False
    for v in vals:
        if v.dim() < 3:  # (a 1-D or 2-D operand: its dimensions are contracted or enumerated)
            return False
        if any(isinstance(d, torch.SymInt) and d.node.expr.free_symbols for d in v.shape[-2:]):
            return False
    return True


#: the Python operators' overloads of the bitwise operations (``mask_a & mask_b``: transformers'
#: and_masks), elementwise as the ``bitwise_*`` ones they call but not tagged pointwise
_BITWISE_OPERATORS = frozenset(
    getattr(getattr(_aten, op), ov) for op in ("__and__", "__or__", "__xor__")
    for ov in ("Tensor", "Scalar") if hasattr(getattr(_aten, op, None), ov))


def _pointwise(target: Any) -> bool:
    """An elementwise operation: torch's pointwise tag, or a bitwise operator."""
    return (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags) \
        or target in _BITWISE_OPERATORS


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def _is_sym(v: Any) -> bool:
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) and \
        bool(v.node.expr.free_symbols)


def _has_sym_shape(v: Any) -> bool:
    return isinstance(v, Tensor) and any(isinstance(s, torch.SymInt) and
                                         bool(s.node.expr.free_symbols) for s in v.shape)


def _batch_degree(val: Any) -> int:
    """The degree in the batch symbol of a tensor's number of elements (tensors in a tuple or
    list: the largest): 1 for example data ``(B, ...)``, ``(B * T, d)``, ``(T, B, d)``; 2 once the
    data is copied along another dimension of size B."""
    if isinstance(val, (tuple, list)):
        return max((_batch_degree(v) for v in val), default=0)
    if not isinstance(val, Tensor):
        return 0
    total = 0
    for size in val.shape:
        if isinstance(size, torch.SymInt):
            expr = size.node.expr
            if expr.free_symbols:
                try:
                    import sympy

                    total += int(sympy.Poly(expr, *expr.free_symbols).total_degree())
                except Exception:  # noqa: BLE001 - not a polynomial (a floor division): once
                    total += 1
    return total


def _sym_arith(target: Any) -> bool:
    """Python / SymPy arithmetic on symbolic sizes (``B * T``, ``B // 2``): its result is another
    symbolic node, whose own uses are checked."""
    mod = getattr(target, "__module__", "") or ""
    return mod in ("_operator", "operator", "math") or \
        getattr(target, "__name__", "").startswith("sym_") and not isinstance(
            target, torch._ops.OpOverload)


def _flat_nodes(a: Any) -> Iterator[Any]:
    if isinstance(a, torch.fx.Node):
        yield a
    elif isinstance(a, (list, tuple)):
        for x in a:
            yield from _flat_nodes(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from _flat_nodes(x)


#: higher-order operators that run a subgraph under another grad mode or autocast state: export
#: emits them for ``with torch.no_grad()`` / ``torch.autocast`` inside the forward (transformers
#: < 5.18 wraps its rotary embeddings in both); the batch symbol reaches the subgraph as an operand
_WRAPPER_HOPS = tuple(getattr(torch.ops.higher_order, n) for n in
                      ("wrap_with_set_grad_enabled", "wrap_with_autocast")
                      if hasattr(torch.ops.higher_order, n))


def _inline_wrappers(gm: torch.fx.GraphModule) -> str | None:
    """Replace each grad-mode / autocast wrapper call in ``gm``'s graph (in place) by the operations
    of its subgraph, so that the check sees every operation on the data and the batch symbol as if
    the forward had no such context. A grad mode or autocast state changes neither which values an
    operation reads nor which positions it combines, so the batch-symbol rules apply unchanged.
    Returns a reason (not proven) for a wrapper whose layout is not the one understood here."""
    graph = gm.graph
    for _ in range(64):  # nested wrappers: one level per round
        hops = [n for n in graph.nodes if n.op == "call_function" and n.target in _WRAPPER_HOPS]
        if not hops:
            return None
        for node in hops:
            subs = [(i, a) for i, a in enumerate(node.args)
                    if isinstance(a, torch.fx.Node) and a.op == "get_attr"
                    and isinstance(getattr(gm, a.target, None), torch.fx.GraphModule)]
            if len(subs) != 1:
                return f"not proven: {node.target} without one subgraph"
            i, attr = subs[0]
            sub = getattr(gm, attr.target)
            operands = list(node.args[i + 1:])
            holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            if len(holders) != len(operands) or node.kwargs:
                return f"not proven: {node.target} with {len(operands)} operands"
            env = dict(zip(holders, operands))
            results: Any = None
            with graph.inserting_before(node):
                for sn in sub.graph.nodes:
                    if sn.op == "placeholder":
                        continue
                    if sn.op == "output":
                        results = torch.fx.node.map_arg(sn.args[0], lambda n: env[n])
                        continue
                    if sn.op == "get_attr":  # a nested subgraph or constant: lift it into gm
                        name = f"_dpclip_inl_{len(list(gm.named_children()))}_{sn.target}"
                        setattr(gm, name, getattr(sub, sn.target))
                        new = graph.get_attr(name)
                        new.meta = dict(sn.meta)
                        env[sn] = new
                        continue
                    env[sn] = graph.node_copy(sn, lambda n: env[n])
            outs = list(results) if isinstance(results, (list, tuple)) else [results]
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem \
                        and isinstance(user.args[1], int) and not user.kwargs:
                    user.replace_all_uses_with(outs[user.args[1]])
                    graph.erase_node(user)
                else:
                    return f"not proven: the result of {node.target} used whole by {user.target}"
            graph.erase_node(node)
    return "not proven: wrappers nested more than 64 deep"


def _check_graph(ep: Any, uniform_out: set[str] | None = None) -> str | None:
    """The first use of the batch symbol other than as a size, or None. ``uniform_out``: filled
    with the names of the constants shaped by the symbol that are UNIFORM (:func:`_uniform_after`)."""
    not_inlined = _inline_wrappers(ep.graph_module)
    if not_inlined:
        return not_inlined
    graph = ep.graph_module.graph
    user_inputs = set(ep.graph_signature.user_inputs)
    data: set[str] = set()
    shaped: set[str] = set()  # constants whose shape involves the batch symbol
    # the shaped constants whose values are the same along every dimension that involves the
    # symbol, and free of it (_uniform_after): e.g. transformers' decoder mask torch.ones(B, T)
    uniform: set[str] = set()
    # arange(n) with n a size involving the symbol, moved or copied without computing (values in
    # [0, n) at every element): name -> the expression n (_row_index)
    rows: dict[str, Any] = {}
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if node.name in user_inputs:
                data.add(node.name)
            continue
        if node.op == "output":
            for a in _flat_nodes(node.args):
                if _is_sym(a.meta.get("val")):
                    return "the batch size is an output of the loss"
            continue
        if node.op != "call_function":
            continue
        target = node.target
        packet = _packet(target)
        name = getattr(target, "__name__", str(target))
        ins = list(_flat_nodes((node.args, node.kwargs)))
        is_data = packet not in _SHAPE_ONLY and any(a.name in data for a in ins)
        # 1. symbolic sizes as arguments
        for i, a in enumerate(node.args):
            nodes_here = list(_flat_nodes(a))
            syms = [n for n in nodes_here if _is_sym(n.meta.get("val"))]
            if not syms:
                continue
            if _sym_arith(target) or target is operator.getitem:
                continue
            if packet in _SIZE_LIST_OPS and isinstance(a, (list, tuple)):
                continue
            if packet is _aten.affine_grid_generator and i == 1 and \
                    isinstance(a, (list, tuple)) and a and \
                    not any(_is_sym(n.meta.get("val")) for n in _flat_nodes(list(a[1:]))):
                continue  # the size (N, C, H, W): the batch size as N, the grids' rows, only
            if i in _SIZE_SCALAR_ARGS.get(target, ()):
                continue
            if target is _aten.slice.Tensor and i == 2 and is_data:
                continue  # a batch-dependent start on example data: the real-batch trace sees it
            if packet in (_aten.sym_size, _aten.sym_numel, _aten.sym_stride):
                continue
            if any(free_unbacked_symbols(n.meta.get("val")) for n in syms):
                return (f"a value read from batch data into Python (.item(), a data-dependent "
                        f"size) is used by {name}: it can carry one example into every other's "
                        "computation")
            return (f"the batch size is used as a value by {name} (e.g. a loss divided by "
                    "len(y) or x.shape[0], a constant filled with it, an index computed from it)")
        for k, a in node.kwargs.items():
            if any(_is_sym(n.meta.get("val")) for n in _flat_nodes(a)):
                if not (packet in _SIZE_LIST_OPS and isinstance(a, (list, tuple))):
                    return f"the batch size is used as a value by {name} (argument {k})"
        # 2. constants shaped by the batch size
        from_shaped = [a for a in ins if a.name in shaped]
        if is_data and _batch_degree(val) > 1:
            # example data copied along a dimension of size B (expand / repeat / broadcast
            # against a (1, B, 1) constant): each row holds its own example only, so the trace
            # sees it row separable, but a product, sum or scan along the copies makes B a value
            # ((-1) ** B: seventeenth hostile review, LOO 7.35 C). Examples' data has B once
            return (f"example data is given a dimension of the batch size besides its rows by "
                    f"{name} (e.g. x[:, None].expand(-1, B, -1)): a reduction along it can carry "
                    "the batch size")
        if is_data:
            if from_shaped and not _combines_positionwise(target, packet, node):
                # e.g. einsum('bi,ci->bi', x, ones_like(x)) sums B ones into every row: the
                # real-batch trace sees only public constants there (hostile review, issue 31)
                return (f"a constant whose shape is the batch size ({from_shaped[0].name}) is "
                        f"combined with example data by {name}, which may contract or reduce "
                        "over it: its values can carry the batch size")
            data.add(node.name)
            continue
        if _is_sym(val) or isinstance(val, (int, float, bool)) and not from_shaped:
            continue
        if from_shaped:
            others = [a for a in ins if a.name not in shaped]
            ok = (packet in _MOVES or packet in _SHAPE_ONLY or packet in _RANDOM
                  # a uniform constant read at any row: the values of its common row, at the
                  # positions given by B-free indices (_uniform_index)
                  or _uniform_index(node, shaped, uniform, rows)
                  or target is operator.getitem
                  # a B-free table read at each position of a B-shaped index (BERT's expanded
                  # token type ids): out[i] = W[idx[i]], still a function of the position
                  or (packet is _aten.embedding and len(node.args) > 1
                      and node.args[1] in from_shaped and node.args[0] not in from_shaped)
                  # a grid per row of a B-shaped theta (a fixed warp expanded to the batch):
                  # out[i] from theta[i] alone, still a function of the position
                  or (packet is _aten.affine_grid_generator and from_shaped == [node.args[0]])
                  or (_pointwise(target)
                      and not any(_has_sym_shape(a.meta.get("val")) for a in others)
                      and len(from_shaped) == 1)
                  # where(cond, a, b) is elementwise (out[i] from cond[i], a[i], b[i]) but only
                  # its Tensor-Tensor overload carries the pointwise tag; transformers' eager
                  # attention builds its (B, 1, T, T) mask this way from an expanded constant
                  or (target in _WHERE
                      and not any(_has_sym_shape(a.meta.get("val")) for a in others)))
            if not ok:
                return (f"a constant whose shape is the batch size ({from_shaped[0].name}) is "
                        f"used by {name}: its values can carry the batch size (e.g. "
                        "ones(B).sum(), arange(B).max())")
            if packet not in _SHAPE_ONLY and isinstance(val, Tensor) and not _has_sym_shape(val):
                # cut to a shape without B: which of its elements it keeps depends on B once
                # B is folded with other dimensions (zeros(8, B) with row 0 filled, flattened,
                # element 7; or as_strided from a (1, 1) slice: fourteenth hostile review, LOO
                # 2.81 C). Positions are the examples' only while B stays a dimension
                return (f"a constant whose shape is the batch size ({from_shaped[0].name}) is "
                        f"cut by {name} to a shape without it: which of its elements remain can "
                        "depend on the batch size (e.g. zeros(8, B).flatten()[7:8])")
        if _has_sym_shape(val) or (isinstance(val, (tuple, list)) and
                                   any(_has_sym_shape(v) for v in val)):
            shaped.add(node.name)
            if _uniform_after(node, packet, ins, shaped, uniform, rows):
                uniform.add(node.name)
            n = _row_index(node, packet, rows)
            if n is not None:
                rows[node.name] = n
    if uniform_out is not None:
        uniform_out.update(uniform)
    return None


#: factories whose every element is one B-free value (a symbolic fill value is refused above)
_FILLS = {_aten.ones, _aten.zeros, _aten.full, _aten.new_ones, _aten.new_zeros, _aten.new_full,
          _aten.ones_like, _aten.zeros_like, _aten.full_like}
#: copies that keep every element where it is (dtype, device, memory)
_SAME_PLACE = {_aten._to_copy, _aten.to, _aten.clone, _aten.contiguous, _aten.detach,
               _aten.alias, _aten.lift_fresh_copy, _aten.type_as}


def _uniform_after(node: Any, packet: Any, ins: list[Any], shaped: set[str],
                   uniform: set[str], rows: dict[str, Any]) -> bool:
    """Whether the constant ``node`` (shaped by the batch symbol) is UNIFORM: its elements are
    the same along every dimension whose size involves the symbol, and their values are free of
    it. Made by a fill with a B-free value (``torch.ones(B, T)``), an expand of a B-free tensor,
    kept by copies that leave every element in place and by elementwise operations whose other
    operands are B-free, and by :func:`_uniform_index`. Nothing else is uniform (a reshape can
    fold the symbol's dimension into another, a slice can cut it)."""
    if packet in _FILLS:  # (a tensor argument is read for its shape, dtype and device only)
        return True
    if packet is _aten.expand:
        src = node.args[0]
        return isinstance(src, torch.fx.Node) and src.name not in shaped \
            and not _has_sym_shape(src.meta.get("val"))
    if packet is _aten.index:
        return _uniform_index(node, shaped, uniform, rows)
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node) or first.name not in uniform:
        return False
    if packet in _SAME_PLACE:
        return True
    if _pointwise(node.target) or node.target in _WHERE:
        return all(a.name not in shaped or a.name in uniform for a in ins)
    return False


#: moves and copies that keep an index tensor's values (each element one of the source's)
_KEEP_VALUES = _SAME_PLACE | {_aten.unsqueeze, _aten.view, _aten.reshape, _aten._unsafe_view,
                              _aten.expand}


def _row_index(node: Any, packet: Any, rows: dict[str, Any]) -> Any:
    """The expression ``n`` when ``node`` is ``arange(n)`` (``n`` a size involving the batch
    symbol, start 0, step 1) or a move or copy of one (:data:`_KEEP_VALUES`): every element is
    then in ``[0, n)``, so it indexes a dimension of size ``n`` in range whatever ``n`` is."""
    if node.target is _aten.arange.default and node.args:
        end = node.args[0]
        val = end.meta.get("val") if isinstance(end, torch.fx.Node) else None
        if isinstance(val, torch.SymInt) and val.node.expr.free_symbols:
            return val.node.expr
        return None
    if packet in _KEEP_VALUES and node.args and isinstance(node.args[0], torch.fx.Node):
        return rows.get(node.args[0].name)
    if packet is _aten.slice and node.args and isinstance(node.args[0], torch.fx.Node) and \
            node.args[0].name in rows:
        # x[:, None]'s full slice: start 0, step 1, the shape unchanged (every element kept)
        start = node.args[2] if len(node.args) > 2 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        src, out = node.args[0].meta.get("val"), node.meta.get("val")
        if start in (0, None) and step == 1 and isinstance(src, Tensor) and \
                isinstance(out, Tensor) and _exprs(src.shape) == _exprs(out.shape):
            return rows[node.args[0].name]
    return None


def _exprs(shape: Any) -> tuple:
    """A shape's sizes as sympy expressions or ints (compared without guards)."""
    return tuple(d.node.expr if isinstance(d, torch.SymInt) else d for d in shape)


def _uniform_index(node: Any, shaped: set[str], uniform: set[str],
                   rows: dict[str, Any]) -> bool:
    """``index.Tensor(C, indices)`` with ``C`` uniform (:func:`_uniform_after`), every index into
    a dimension of ``C`` whose size ``n`` involves the batch symbol an ``arange(n)`` (moved or
    copied: :func:`_row_index`; transformers' mask builder's row index), and every index into
    another dimension B-free: each element of the output is ``C``'s common row at B-free
    positions, so the output is uniform too. Other indices into the symbol's dimensions (a
    ``full((B,), 5)``, in range only for some batch sizes) and indices into B-free dimensions
    shaped by the symbol (whose values could pick positions that depend on it) are not this
    case."""
    if _packet(node.target) is not _aten.index or len(node.args) < 2:
        return False
    src, idx = node.args[0], node.args[1]
    if not isinstance(src, torch.fx.Node) or src.name not in uniform \
            or not isinstance(idx, (list, tuple)):
        return False
    shape = getattr(src.meta.get("val"), "shape", None)
    if shape is None or len(idx) > len(shape):
        return False
    for d, ix in enumerate(idx):
        if ix is None:
            continue
        if not isinstance(ix, torch.fx.Node):
            return False
        on_symbol = isinstance(shape[d], torch.SymInt) and bool(shape[d].node.expr.free_symbols)
        if on_symbol:
            # in range by construction (an index that fails for some batch sizes only, a
            # full((B,), 5) at B <= 5, would make whether the step runs depend on B)
            if ix.name not in rows or rows[ix.name] != shape[d].node.expr:
                return False
        elif ix.name in shaped or _has_sym_shape(ix.meta.get("val")):
            return False
    return True


@_cm.contextmanager
def _as_in_the_real_run() -> Iterator[None]:
    """The user code the proof runs sees the compile flags the real run sees: the real run is made
    to take libraries' export paths (:func:`data_independent_paths` sets
    ``torch.compiler.is_exporting()``), but ``torch.export`` also sets ``is_compiling()``, which
    the real run does not. Libraries branch on that one too (transformers < 5.18 builds the
    attention mask and the rotary positions another way when ``is_compiling()``), so the proof
    would trace a program the real run does not run, and every step would be refused. Set back
    before the export machinery continues."""
    import torch.compiler as tc

    if not hasattr(tc, "_is_compiling_flag"):
        yield
        return
    saved = tc._is_compiling_flag
    tc._is_compiling_flag = False
    try:
        yield
    finally:
        tc._is_compiling_flag = saved


class _LossOfModel(nn.Module):
    def __init__(self, model: nn.Module | Callable[..., Any],
                 loss_fn: Callable[..., Tensor], expand: tuple[tuple[nn.Module, bool], ...] = ()
                 ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.expand = expand  # a plain tuple: not registered as submodules

    def forward(self, xs: Any, ys: Any) -> Tensor:
        # the operations the proof runs are recorded (post-autograd, as a dispatch mode sees an
        # eager run): the real run must be this program (dpclip.engine.proved_program)
        rec = ProgramRecorder(self.model, xs, ys)
        with rec, _as_in_the_real_run():
            if not self.expand:
                out = call_model(self.model, xs)
                rec.model_output(out)
                losses = self.loss_fn(out, ys)
            else:
                from dpclip.engine.batchless import as_example_rows, expanding_hooks

                # the batch-less calls of these layers are expanded to the (symbolic) batch size,
                # as the ghost engine runs them, and are example data (dpclip.engine.batchless);
                # engine code, not recorded: the expansion stands for the layer's output
                first = next(t for t in pytree.tree_leaves(xs) if isinstance(t, Tensor))

                def expand(out: Tensor) -> Tensor:
                    with rec.engine():
                        got = as_example_rows(out, first)
                    rec.alias(got, out)
                    return got

                with expanding_hooks(self.expand, expand):
                    out = call_model(self.model, xs)
                    rec.model_output(out)
                    losses = self.loss_fn(out, ys)
            rec.loss_output(losses)
        self.program = rec.finish()
        return losses


_PLAIN = (int, float, bool, str, type(None))


#: exact types that are plain (kept in the key) or never plain (skipped) without an isinstance
_PLAIN_EXACT = frozenset({int, float, bool, str, type(None)})
_NOT_PLAIN_EXACT = frozenset({dict, set, list, collections.OrderedDict})
_NONE_TYPE = type(None)


def plain_exact(t: type) -> bool:
    """``plain_exact(t)`` by identity: a set lookup hashes ``t``, and a class whose metaclass
    has a ``__hash__`` of its own would run it (hundred-and-twenty-second hostile review)."""
    return t is float or t is int or t is str or t is bool or t is _NONE_TYPE


def _not_plain_exact(t: type) -> bool:
    return t is dict or t is list or t is set or t is collections.OrderedDict


#: a module's hook registries (with their flags): what the call runs besides ``forward``
_HOOK_DICTS = frozenset({"_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                         "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
                         "_backward_hooks", "_backward_pre_hooks"})


def _python_state(mod: nn.Module) -> tuple:
    """The plain Python attributes of a module (counters, flags, sizes): a forward that changes
    what it computes with them gets a new proof when they change. Its hooks and an instance's own
    ``forward`` too, by identity (seventy-seventh hostile review: a hook registered, or
    ``forward`` replaced, after the graph was adopted never ran: the compiled steps trained the
    program without it). (Exact builtin types are sorted
    by a set lookup; anything else, subclasses of int such as enums included, by isinstance.)"""
    got = []
    for k, v in vars(mod).items():
        t = type(v)
        if plain_exact(t):
            got.append((k, v))
        elif _not_plain_exact(t):
            if v and k in _HOOK_DICTS:  # (by identity: a hook added or removed, a new proof)
                got.append((k, tuple((h, _identity(f)) for h, f in v.items())))
            continue
        elif k == "forward":  # an instance's own forward (``m.forward = ...``): by identity
            got.append((k, _identity(v)))
        elif issubclass(t, _PLAIN) or (issubclass(t, tuple) and all(
                issubclass(type(x), _PLAIN) for x in tuple.__iter__(v))):
            # (by the type alone: isinstance reads v.__class__, a property of the model's class,
            # whose code ran here; hundred-and-sixteenth hostile review)
            got.append((k, _plain(v)))  # (a subclass's own __hash__ / __eq__ never decide)
    return tuple(got)


def _plain(v: Any) -> Any:
    """A plain attribute (an ``int`` / ``float`` / ``str`` subclass, an enum, a tuple of them) in
    the key by its type and its builtin value, read with the builtin's own method: never by its
    ``__dict__``, which the isolation does not compare (seventh hostile review: ``self.tag.k =
    example`` on an ``int`` subclass changed the key, a fresh proof took the carried value: LOO
    2.51 C), nor by a ``__hash__`` / ``__eq__`` of its own."""
    t = type(v)  # (the type alone, and the builtins' own methods: no code of the class runs)
    if issubclass(t, tuple):
        return (_Same(t), tuple(_plain(x) for x in tuple.__iter__(v)))
    if plain_exact(t):
        return (t, v.hex() if t is float else v)
    if issubclass(t, int):
        return (_Same(t), int.__index__(v))
    if issubclass(t, float):
        return (_Same(t), float.hex(float.__float__(v)))
    if issubclass(t, str):
        return (_Same(t), str.__str__(v))
    return _Same(v)


class _Same:
    """An object in a proof-cache key by identity: its own ``__hash__`` and ``__eq__`` are never
    called (fifth hostile review: an ``int`` subclass whose hash changed on every call, or a loss
    without a hash, got a fresh proof on every call; the proof then took the previous call's
    example, left in a global, as a public constant: a later call moved by 0.75 C, LOO 2.51 C at
    ``max_physical_batch=1``). Keeps the object alive, so that its ``id`` is not reused."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return ident(self.obj)

    def __eq__(self, other: object) -> bool:
        return type(other) is _Same and other.obj is self.obj


_MAPS = (dict, collections.OrderedDict)


def _canon(v: Any, depth: int = 4) -> Any:
    """``v`` as a proof-cache key part that user code cannot make miss at will: exact builtin
    scalars by value, tuples, lists and dicts by their canonical items, a function by its code,
    globals, defaults and closure, a bound method or ``functools.partial`` by its parts, an
    object with a ``__dict__`` (a loss object, a ``torch.nn`` loss module) by its type and
    canonical attributes (``__slots__`` too), sets by their canonical items, anything else (a
    tensor, what lies deeper than ``depth``) by identity. Used after the identity of the loss
    (:func:`proof_of`): an object reused from call to call hits by identity whatever its state
    now (its changed state then fails the match); a new loss object each step built from the same
    constants (``nn.CrossEntropyLoss()``, ``functools.partial(F.cross_entropy, ...)``) hits by
    this form (seventh hostile review: with its containers by identity it missed every step and a
    fresh proof took a carried global as a constant, 0.75 C).

    A key that hits reuses a proof, and the real run must then still match that proof's program
    operation by operation, constants included (:mod:`dpclip.engine.proved_program`): a coarse
    key can only refuse a step, never accept another program. A key that misses is the danger: a
    fresh proof takes whatever Python values the forward reads then as public constants. So
    two calls that pass equal but distinct objects (a new ``lambda`` or loss object each step)
    reuse one proof."""
    t = type(v)
    if plain_exact(t):
        return (t, v.hex()) if t is float else (t, v)  # (hex: one NaN equals another)
    if depth <= 0:
        return _Same(v)
    d = depth - 1
    if t is tuple or t is list:
        return (t, tuple(_canon(x, d) for x in v))
    if t is dict or t is collections.OrderedDict:
        return (t, tuple((_canon(k, d), _canon(x, d)) for k, x in v.items()))
    if t is set or t is frozenset:
        return (t, frozenset(_canon(x, d) for x in v))
    if t is types.FunctionType:
        cells = []
        for c in v.__closure__ or ():
            try:
                cells.append(_canon(c.cell_contents, d))
            except ValueError:  # an empty cell
                cells.append(None)
        return ("function", v.__code__, _Same(v.__globals__), _canon(v.__defaults__, d),
                _canon(v.__kwdefaults__, d), tuple(cells))
    if t is types.MethodType:
        return ("method", _canon(v.__func__, d), _canon(v.__self__, d))
    if t is functools.partial:
        return ("partial", _canon(v.func, d), _canon(v.args, d), _canon(v.keywords, d))
    if isinstance(v, (Tensor, type, types.ModuleType, types.BuiltinFunctionType)):
        return _Same(v)
    attrs = getattr(v, "__dict__", None)
    slots = _slots(t)
    if type(attrs) is dict or (attrs is None and slots):
        return ("object", t,
                tuple((k, _canon(x, d)) for k, x in (attrs or {}).items()),
                tuple((n, _canon(getattr(v, n, _Same), d)) for n in slots))
    return _Same(v)


def _slots(t: type) -> tuple[str, ...]:
    """The ``__slots__`` names of a class and its bases (a loss class without ``__dict__``)."""
    got: list[str] = []
    for c in t.__mro__:
        names = c.__dict__.get("__slots__", ())
        got += [names] if isinstance(names, str) else [n for n in names if n not in
                                                         ("__dict__", "__weakref__")]
    return tuple(got)


def _modules(model: nn.Module) -> list[nn.Module]:
    """``model.modules()`` (each module once), by an explicit stack instead of nested generators
    (this runs on every step)."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        m = stack.pop()
        if ident(m) in seen:
            continue
        seen.add(ident(m))
        out.append(m)
        children = m.__dict__.get("_modules")
        if children:
            stack.extend(c for c in reversed(children.values()) if c is not None)
        inner = view_inner(m)
        if inner is not None:  # (a library view: the model it views, dpclip.engine.views)
            stack.append(inner)
    return out


def _signature(model: Any, xs: Any, ys: Any) -> tuple:
    if type(xs) is Tensor and type(ys) is Tensor:  # the common case, without pytree's spec string
        leaves, spec = [xs, ys], "tensor, tensor"
    else:
        leaves, spec = pytree.tree_flatten((xs, ys))
    sig = tuple((tuple(t.shape[1:]), t.dtype, t.device.type) if isinstance(t, Tensor) else
                (type(t).__name__,) for t in leaves)
    if not isinstance(model, nn.Module):
        return (str(spec), sig, (), ())
    modules = _modules(model)
    mods = tuple((type(m), _python_state(m)) for m in modules)
    return (str(spec), sig, mods, _ties(modules))


def _ties(modules: list[nn.Module]) -> tuple:
    """Which parameter slots hold the same parameter object (module position, name): a tie made
    or broken between steps is another program, proved again (ninety-seventh review: it was
    refused as a program mismatch, a hard stop for an honest user)."""
    slots: dict[int, list[tuple[int, str]]] = {}
    for i, m in enumerate(modules):
        params = m.__dict__.get("_parameters")
        if params:
            for name, p in params.items():
                if p is not None:
                    slots.setdefault(ident(p), []).append((i, name))
    return tuple(tuple(v) for v in slots.values() if len(v) > 1)


def _autocast_key() -> tuple:
    """The autocast regions around the step (device type and dtype of each one on): a program
    proved without autocast is another program under it (every operation's dtype changes), so a
    step that switches autocast on gets a proof of its own instead of a refused match."""
    got = []
    for dev in ("cpu", "cuda", "xpu", "mps", "hpu"):
        try:
            if torch.is_autocast_enabled(dev):
                got.append((dev, torch.get_autocast_dtype(dev)))
        except (RuntimeError, TypeError, ValueError, AttributeError):  # (a device this build lacks)
            continue
    return tuple(got)


#: the proofs of each model, by identity (a model whose ``__hash__`` changes on every call found
#: no proof, and a graph's first step proved another program in its graph pass:
#: test_auto_probe.test_the_verdict_is_kept_by_identity_not_by_hash)
_CACHE: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _identity(fn: Any) -> Any:
    """``fn`` by identity; a bound method by its function's and its object's (``obj.loss`` is a
    new method object at each access: by its canonical form, the object's state carried from the
    last call would make every call miss)."""
    if type(fn) is types.MethodType:
        return ("method", _Same(fn.__func__), _Same(fn.__self__))
    return _Same(fn)


class _Proofs:
    """One model's proofs: by the loss object's identity (the last 64 objects) and by its
    canonical form (:func:`proof_of`)."""

    __slots__ = ("by_identity", "alike")

    def __init__(self) -> None:
        self.by_identity: collections.OrderedDict = collections.OrderedDict()
        self.alike: dict = {}

    def clear(self) -> None:
        self.by_identity.clear()
        self.alike.clear()


#: the proofs of models that are plain callables, by their canonical form (:func:`_canon`)
_CALLABLES: dict[Any, _Proofs] = {}


def batch_size_uses(model: nn.Module | Callable[..., Any], loss_fn: Callable[..., Tensor], xs: Any,
                    ys: Any, expand: tuple[tuple[nn.Module, bool], ...] = ()) -> str | None:
    """``None`` when ``loss_fn(model(xs), ys)`` is proved to use the batch size only as a size
    (see the module docstring), else the reason (a use as a value, or "not proven": the forward
    could not be traced with a symbolic batch size). Cached per model, loss function and input
    signature without the batch size. ``expand``: ``(module, output_only)`` pairs whose batch-less
    calls the engine expands to the batch (:mod:`dpclip.engine.batchless`); the proof then traces
    that program.

    Privacy: runs the model on fake tensors only (no values of ``xs``/``ys`` are read); the verdict
    holds for every batch size >= 2 FOR THE PROGRAM THE PROOF RAN: a caller that then runs the
    real forward must check that it runs that program (:func:`proof_of` gives it). Edge cases:
    inputs must have the batch as dimension 0 of every tensor leaf (as the engines require); a
    batch of one example is not checked by the caller."""
    return proof_of(model, loss_fn, xs, ys, expand)[0]


def proof_of(model: nn.Module | Callable[..., Any], loss_fn: Callable[..., Tensor], xs: Any,
             ys: Any, expand: tuple[tuple[nn.Module, bool], ...] = ()
             ) -> tuple[str | None, ProvedProgram | None]:
    """``(reason, program)``: the verdict of :func:`batch_size_uses` and the operations the proof
    ran (:class:`~dpclip.engine.proved_program.ProvedProgram`; None where the trace failed), which
    the real run must match operation by operation
    (:class:`~dpclip.engine.proved_program.ProgramMatch`): user Python can tell the proof's fake
    tensors from real ones, so the verdict alone says nothing about a different real run."""
    if isinstance(model, nn.Module):
        per_model = _CACHE.get(model)
        if per_model is None:
            per_model = _CACHE[model] = _Proofs()
    else:  # a plain callable: by its canonical form (a new lambda each step is the same model)
        if len(_CALLABLES) > 64:
            _CALLABLES.clear()
        per_model = _CALLABLES.setdefault(_canon(model), _Proofs())
    # no user __hash__ / __eq__ decides whether a key hits: the loss by identity first (the same
    # object as before hits whatever it holds now: a state it carried from the last call then
    # fails the match, sixth hostile review: keyed by its attributes' values, every call missed
    # and a fresh proof took the carried value as a constant, 0.74 C), then by its canonical form
    # (a new lambda or loss object each step reuses the proof: fifth review)
    rest = (_signature(model, xs, ys), tuple((ident(m), f) for m, f in expand), _autocast_key())
    key = (_identity(loss_fn),) + rest
    got = per_model.by_identity.get(key)
    if got is not None:
        return got
    alike = (_canon(loss_fn),) + rest
    got = per_model.alike.get(alike)
    if got is None:
        # (what the proof's run of the forward seeds is undone; so is what it left in the
        # model classes' memoising caches: fake tensors). The proof is kept as for any model: a
        # later step whose real run HITS a cache the proof filled runs another program and is
        # refused by the match, never re-proved with the cached value (filled by a private step's
        # real run, it can hold that step's batch size: re-proving read it as a constant, 2.64 C
        # across steps, sixty-third hostile review)
        # (and dpclip's registry of past and current batches is empty while the forward runs
        # there: read, it gave the proof the step's own batch, hundred-and-seventieth review)
        with defaults_unchanged(), caches_of_the_proof_cleared(model), past_batches_hidden():
            got = _export_check(model, loss_fn, xs, ys, expand)
        if len(per_model.alike) >= 64:
            per_model.alike.clear()
        per_model.alike[alike] = got
    ids = per_model.by_identity
    ids[key] = got
    while len(ids) > 64:  # (the oldest loss objects: a new lambda each step leaves one a step)
        ids.popitem(last=False)
    return got


_LRU = functools._lru_cache_wrapper
_TYPE_MRO = type.__dict__["__mro__"].__get__
_TYPE_DICT = type.__dict__["__dict__"].__get__


def _method_caches(model: Any) -> list[Any]:
    """The ``functools.lru_cache`` objects of the methods of ``model``'s module classes (their
    MROs' own dictionaries): a cached method itself (``functools.cache`` on a method), or one held
    in the closure of the method's wrapper (transformers' ``compile_compatible_method_lru_cache``,
    which caches unless Dynamo is compiling: BEiT's relative position index). Read without running
    any of the model's code (exact types, class dictionaries, closure cells)."""
    if not isinstance(model, nn.Module):
        return []
    classes: dict[int, type] = {}
    for m in model.modules():  # (nn.Module's own: a class defining it is refused, check_structure)
        for c in _TYPE_MRO(type(m)):  # (type's own descriptors: no metaclass property runs)
            classes.setdefault(id(c), c)
    found: dict[int, Any] = {}
    for c in classes.values():  # (torch's own classes too: no name a class gives itself decides)
        for v in list(_TYPE_DICT(c).values()):
            if type(v) in (staticmethod, classmethod):
                v = v.__func__
            if type(v) is _LRU:
                found.setdefault(id(v), v)
            elif type(v) is types.FunctionType:
                for cell in v.__closure__ or ():
                    try:
                        got = cell.cell_contents
                    except ValueError:  # (an empty cell)
                        continue
                    if type(got) is _LRU:
                        found.setdefault(id(got), got)
    return list(found.values())


@_cm.contextmanager
def method_caches_cleared(model: Any) -> Iterator[None]:
    """Around each chunk of the ghost engine that runs user code: every memoising cache of the
    model classes' methods (:func:`_method_caches`) is cleared when the chunk starts and when it
    ends, so the proof and the real run both compute what such a method returns (as the kept
    proof did), whatever the user's own calls between steps cached, and nothing a private chunk
    computed stays there: kept, a later proof (another loss, another signature) read it as a
    constant of the program and the real run matched it (sixty-fourth hostile review: a step's
    batch size, 2.05 C across steps). Clearing a cache only costs a recomputation."""
    for c in _method_caches(model):
        c.cache_clear()
    try:
        yield
    finally:  # (found again: a cached method the chunk installed on a class is cleared too)
        for c in _method_caches(model):
            c.cache_clear()


@_cm.contextmanager
def caches_of_the_proof_cleared(model: Any) -> Iterator[None]:
    """Around the batch-size proof: every memoising cache of the model classes' methods
    (:func:`_method_caches`) that missed during the proof is cleared after it. What such a cache
    stored there was computed from the proof's fake tensors; kept, it handed the fake to every
    later call, the real step's (refused as a proof leftover) and the user's own forward after
    training (transformers' BEiT: its logits a FakeTensor)."""
    caches = _method_caches(model)
    before = [c.cache_info().misses for c in caches]
    try:
        yield
    finally:
        for c, n in zip(caches, before):
            if c.cache_info().misses != n:
                c.cache_clear()


#: the rows of the proof's public stand-in of the batch (a prime: no size of a model is likely
#: to equal it, which export's duck sizing would tie to the batch symbol)
_PROOF_ROWS = 61


def _stand_in(tree: Any) -> Any:
    """``tree`` with each tensor replaced by zeros of its dtype, device and trailing shape with
    :data:`_PROOF_ROWS` rows, its dimensions laid out in the same stride order, requiring grad
    where it does (public: neither the step's values nor its size)."""
    def one(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.dim() == 0:
            return t
        shape = (_PROOF_ROWS, *t.shape[1:])
        order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
        with _cm.no_grad():
            z = torch.zeros([shape[d] for d in order], dtype=t.dtype, device=t.device)
            back = [order.index(d) for d in range(t.dim())]
            z = z.permute(back)
        # (a batch that requires grad is proved as one: the real run's match compares it)
        return z.detach().requires_grad_(True) if t.requires_grad else z
    return pytree.tree_map(one, tree)


def _export_check(model: nn.Module | Callable[..., Any], loss_fn: Callable[..., Tensor], xs: Any,
                  ys: Any, expand: tuple[tuple[nn.Module, bool], ...] = ()
                  ) -> tuple[str | None, ProvedProgram | None]:
    from torch.export import Dim, export

    batch_dim = Dim("batch", min=2)
    dynamic = pytree.tree_map(lambda t: {0: batch_dim} if isinstance(t, Tensor) else None,
                              (xs, ys))
    traced = _LossOfModel(model, loss_fn, expand)
    # the export runs on a PUBLIC stand-in of the batch, never on the step's tensors: torch's fake
    # mode keeps the tensors it was given (its meta converter's describer) and the symbolic size
    # its hint, both readable by the forward's Python while it is traced, which baked the
    # examples' values (a literal made from them: 2.93-15.2 C) or the padded batch size (25.1 C)
    # into the proved program (hundred-and-sixty-ninth hostile review, also at the session's
    # start): zeros of the batch's structure, dtypes and layouts, with _PROOF_ROWS rows
    xs, ys = _stand_in(xs), _stand_in(ys)
    try:
        with warnings.catch_warnings(), _eager_kernels(), proof_export():
            warnings.simplefilter("ignore")
            ep = export(traced, (xs, ys), dynamic_shapes=dynamic, strict=False)
    except Exception as exc:  # noqa: BLE001 - any failure to trace is "not proven"
        # numbers masked: an error text can quote a size, and the batch size is private
        first = re.sub(r"\d+", "#", (str(exc).strip().splitlines() or
                                     [type(exc).__name__])[0][:300])
        if "Constraints violated" in str(exc) or "specializ" in str(exc):
            return ("the batch size is used as a Python value (len(), int(), range(), a "
                    "condition on x.shape[0], ...): the trace with a symbolic batch size "
                    f"specialised it ({first})"), None
        return ("not proven: the forward and loss could not be traced with a symbolic batch "
                f"size ({type(exc).__name__}: {first}); Python escapes such as .numpy(), "
                ".tolist(), .item() or control flow on data values cannot be checked"), None
    # the exported program keeps the arguments it was traced with: the step's (private) batch,
    # which the proof's cache must not hold after the step
    ep.example_inputs = None
    program = getattr(traced, "program", None)
    if program is None:
        return "not proven: the proof's trace did not run the forward", None
    # (for the compiled engine, which runs this graph instead of the user's code,
    # dpclip.engine.compiled: whether the forward had grad-mode or autocast regions, which
    # _check_graph inlines, and the constants it proved uniform)
    wrapped = any(n.op == "call_function" and n.target in _WRAPPER_HOPS
                  for n in ep.graph_module.graph.nodes)
    uniform: set[str] = set()
    why = _check_graph(ep, uniform)
    program.exported = (ep, frozenset(uniform), wrapped) if why is None else None
    return why, program


#: dispatch keys whose Python kernels (``py_impl``) replace the C++ kernels of an eager run
_EAGER_KEYS = (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd,
               torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA)
_PY_KERNEL_OPS: list[Any] | None = None


def _ops_with_python_decompositions() -> list[Any]:
    """The ATen overloads with a Python kernel for a composite or autograd key (``dropout``,
    ``matmul``, ``native_batch_norm``, the upsamplings, ...): under the Python dispatcher that the
    proof's tracing enables they run ``torch._decomp``'s decomposition, in an eager run the C++ one,
    and the two emit different operations (``native_dropout`` vs ``bernoulli_`` + ``div_`` +
    ``mul``)."""
    global _PY_KERNEL_OPS
    if _PY_KERNEL_OPS is None:
        found = []
        aten = torch.ops.aten
        for name in dir(aten):
            packet = getattr(aten, name, None)
            if not isinstance(packet, torch._ops.OpOverloadPacket):
                continue
            for ov in packet.overloads():
                op = getattr(packet, ov, None)
                if op is not None and any(k in op.py_kernels for k in _EAGER_KEYS):
                    found.append(op)
        _PY_KERNEL_OPS = found
    return _PY_KERNEL_OPS


@_cm.contextmanager
def _eager_kernels() -> Iterator[None]:
    """Run the proof with the C++ composite and autograd kernels an eager run uses: the proof
    records its operations for the real run to match (:mod:`dpclip.engine.proved_program`), so
    both must decompose the same way. The Python kernels are put back on exit."""
    import torch.export  # noqa: F401 - registers the decompositions first

    saved = []
    for op in _ops_with_python_decompositions():
        for k in _EAGER_KEYS:
            if k in op.py_kernels:
                saved.append((op, k, op.py_kernels.pop(k)))
        op._dispatch_cache.clear()
    mm = torch.ops.aten.matmul.default
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    mm.py_kernels[key] = _matmul_as_eager
    mm._dispatch_cache.clear()
    ups = _upsamplings()
    for vec, kernel in ups:
        vec.py_kernels[key] = kernel
        vec._dispatch_cache.clear()
    # the recurrent layers by their time-step cells, as the real run computes them under the
    # tracer (dpclip.engine.recurrent: the C++ kernel specialises the batch size)
    rnns = proof_kernels()
    for op, kernel in rnns:
        for k in _EAGER_KEYS[:2]:
            op.py_kernels[k] = kernel
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        mm.py_kernels.pop(key, None)
        for vec, _ in ups:
            vec.py_kernels.pop(key, None)
            vec._dispatch_cache.clear()
        for op, _ in rnns:
            for k in _EAGER_KEYS[:2]:
                op.py_kernels.pop(k, None)
            op._dispatch_cache.clear()
        for op, k, fn in saved:
            op.py_kernels[k] = fn
            op._dispatch_cache.clear()
        mm._dispatch_cache.clear()


#: the upsamplings of ``F.interpolate`` (``.vec`` overloads): nearest (scale factors only) and
#: the interpolating ones (with ``align_corners``)
_UPSAMPLE_NEAREST = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                     "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
                     "_upsample_nearest_exact3d")
_UPSAMPLE_LINEAR = ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d",
                    "upsample_bicubic2d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")


def _upsamplings() -> list[tuple[Any, Callable[..., Tensor]]]:
    """``(vec overload, kernel)`` for each upsampling of ``F.interpolate``: the proof's kernel
    (:func:`_upsample_as_eager`)."""
    aten = torch.ops.aten
    got = []
    for names, linear in ((_UPSAMPLE_NEAREST, False), (_UPSAMPLE_LINEAR, True)):
        for n in names:
            packet = getattr(aten, n, None)
            if packet is not None and "vec" in packet.overloads():
                got.append((packet.vec, _upsample_as_eager(packet.default, linear)))
    return got


def _upsample_as_eager(default: Any, linear: bool) -> Callable[..., Tensor]:
    """The ``.vec`` upsampling (``F.interpolate``) with a symbolic batch size, emitting what the
    eager C++ composite kernel emits: the output size from the spatial sizes and the scale factors
    (``int(size * scale)``, C++'s ``static_cast<int64_t>``), then ONE call of the ``default``
    overload with the output size and one scale per spatial dimension (or None).

    Why: the C++ composite reads ``input.sizes()`` as plain integers (``compute_output_size``),
    the batch size included, which specialises the symbolic batch: every model with
    ``nn.Upsample`` / ``F.interpolate`` (U-Nets, decoders) was refused as "the batch size is used
    as a Python value"; torch's own Python decomposition is symbolic but emits ``_unsafe_index``
    and arithmetic instead of the upsampling, which the real run would not match. As for
    :func:`_matmul_as_eager`, a case this gets wrong cannot make a proof unsound: the real run must
    still match the proof op by op."""

    def kernel(input: Tensor, output_size: Any, *rest: Any) -> Tensor:
        if linear:
            align_corners, scale_factors = rest
        else:
            align_corners, (scale_factors,) = None, rest
        d = input.dim() - 2
        if output_size is not None:
            osize = list(output_size)
        else:
            osize = [int(input.shape[i + 2] * float(s)) for i, s in enumerate(scale_factors)]
        scales = [float(s) for s in scale_factors] if scale_factors is not None else [None] * d
        if linear:
            return default(input, osize, align_corners, *scales)
        return default(input, osize, *scales)

    return kernel


def _matmul_as_eager(t1: Tensor, t2: Tensor) -> Tensor:
    """``torch.matmul`` with a symbolic batch size, emitting the ATen operations of the eager C++
    kernel (``at::native::_matmul_impl``) in the same order with the same arguments, so that the
    real run matches the proof (:mod:`dpclip.engine.proved_program`).

    Why: the C++ kernel of torch <= 2.11 reads a 3-D or larger operand's sizes as plain integers,
    which specialises the symbolic batch size: every model with a batched matmul (every eager
    attention: BERT, GPT-2, Llama, ViT) was refused as "the batch size is used as a Python value"
    on the GPU machines' torch 2.11 while torch 2.13 proved them. torch's own Python
    decomposition is symbolic but emits other operations (no transpose where the C++ kernel
    tests a fold of the transposed product; a squeeze only when ``requires_grad``), so the real
    run would not match it. Matrices and vectors (no batch to specialise) run the C++ kernel.
    A case this function gets wrong cannot make a proof unsound: the real run's operations must
    still match it one by one (tests/engine/test_matmul_as_eager.py compares them with the eager
    kernel's on real tensors)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

    aten = torch.ops.aten
    d1, d2 = t1.dim(), t2.dim()
    if d1 == 0 or d2 == 0 or (d1 <= 2 and d2 <= 2):
        with torch._C._DisablePythonDispatcher():
            return aten.matmul.default(t1, t2)
    if _folds_as_eager(t1, t2):
        transpose = d2 > d1
        a = t2.mT if transpose else t1
        b = (t1.t() if d1 == 2 else t1) if transpose else t2
        sizes = list(a.shape)
        out_shape = sizes[:-1]
        folded = functools.reduce(operator.mul, out_shape)
        a_folded = a.reshape(folded, sizes[-1])
        if b.dim() == 2:
            out = aten._unsafe_view(a_folded.mm(b), out_shape + [b.shape[1]])
            return out.mT.contiguous() if transpose else out
        return aten._unsafe_view(a_folded.mv(b), out_shape)
    n = t1.size(-2) if d1 > 1 else 1
    m1 = t1.size(-1)
    batch1 = list(t1.shape[:-2])
    m2 = t2.size(-2) if d2 > 1 else t2.size(-1)
    p = t2.size(-1) if d2 > 1 else 1
    batch2 = list(t2.shape[:-2])
    if d1 == 3 and d2 == 3 and guard_or_true(batch1[0] != batch2[0]):
        # (the eager kernel squeezes a batch of one where the operand requires grad or is a
        # tensor subclass, which a tensor seen by a dispatch mode always is)
        if guard_or_false(batch1[0] == 1):
            return _matmul_as_eager(t1.squeeze(0), t2)
        if guard_or_false(batch2[0] == 1):
            return _matmul_as_eager(t1, t2.squeeze(0))
    batch = list(torch.broadcast_shapes(batch1, batch2))
    product = functools.reduce(operator.mul, batch, 1)
    a = t1.expand(batch + [n, m1]).reshape(product, n, m1)
    if d2 == 1:
        b = t2.expand(batch + [m2]).reshape(product, m2).unsqueeze(2)
    else:
        b = t2.expand(batch + [m2, p]).reshape(product, m2, p)
    out_shape = batch + ([n] if d1 > 1 else []) + ([p] if d2 > 1 else [])
    out = a.bmm(b)
    if d2 == 1:
        out = out.squeeze(-1)
    return aten._unsafe_view(out, out_shape)


def _folds_as_eager(tensor1: Tensor, tensor2: Tensor) -> bool:
    """The eager kernel's test for computing a batched-by-matrix product as one ``mm`` (its
    ``should_fold``): the larger operand (transposed where it is the right one: an operation the
    eager kernel emits whatever the answer) must be contiguous up to sizes of one, unless the
    smaller one requires grad. The larger operand is transposed whenever it is the right one."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    d1, d2 = tensor1.dim(), tensor2.dim()
    t1, t2 = (tensor1, tensor2) if d1 >= d2 else (tensor2.mT, tensor1)
    if not (t1.dim() >= 3 and t2.dim() <= 2):
        return False
    if t2.requires_grad:
        return True
    if d1 == 2:
        return False
    if guard_or_false(t1.numel() == 0):
        return True
    expected = 1
    for size, stride in reversed(list(zip(t1.shape, t1.stride()))):
        if not (guard_or_false(size == 1) or guard_or_false(stride == expected)):
            return False
        expected = expected * size
    return True


@_cm.contextmanager
def data_independent_paths() -> Iterator[None]:
    """Make libraries that check ``torch.compiler.is_exporting()`` take their data-independent
    path, as they do in the proof (which runs under ``torch.export``).

    ``transformers`` skips building the attention mask when ``attention_mask.all()`` is true (a
    Python bool read from the WHOLE batch: one example's padding would change every other example's
    attention kernel). Under export it never reads the mask's values and always applies it. Running
    the real forward under the same flag makes the computation the proof saw the computation that
    runs: per example, with the mask applied (numerically equal to the fast path for unpadded rows
    up to the kernel's rounding). Not a whitelist: any other read of batch values is still refused
    by the tracer. The flag is torch's own (``torch.compiler._is_exporting_flag``), restored after
    the block."""
    import torch.compiler as tc

    if not hasattr(tc, "_is_exporting_flag"):
        yield
        return
    old = tc._is_exporting_flag
    tc._is_exporting_flag = True
    try:
        yield
    finally:
        tc._is_exporting_flag = old
