"""The ghost engine's per-layer path: per-example gradients of ONE module's own parameters.

A module that owns trainable parameters but has no ghost rule (a custom layer, an RMSNorm-like norm
of a model zoo such as ``LlamaRMSNorm`` or ``T5LayerNorm``, a container that reads its parameters
directly such as ViT's ``cls_token`` and ``position_embeddings``) does not send the whole model to
``vmap``. Its calls are hooked like the ruled layers' (a forward pre-hook records the arguments and
where the call's autograd nodes start, the forward hook its outputs); the ONE backward pass of the
ghost engine delivers ``b``, the gradient of the summed per-example loss with respect to each
output. The per-example gradient of the module's own parameters is then the vector-Jacobian
product of the module's forward at example ``i``'s arguments with example ``i``'s row of ``b``,

    ``g_i = (d f(theta; args_i) / d theta)^T b_i``,

evaluated for all examples by ``torch.func.vmap`` over ``torch.func.vjp`` of
``functional_call(module, own parameters, args_i)`` (:func:`module_grads`): the module's inputs,
frozen parameters, buffers and children are held fixed, so this is the call's LOCAL derivative and
a module called several times (its own output as input included) gets one vector per call, summed
like any parameter used by several calls. For a parameter read directly (``cls_token.expand(B, -1,
-1)``, ``x + position_embeddings``) this is the gradient flowing into its broadcast use, summed over
the broadcast dimensions of one example. The vectors are kept and the weighted sum is their
weighted reduction, so the norm that sets an example's weight is the norm of the very vector summed.

Soundness (privacy): example ``i``'s vector is computed from example ``i``'s arguments and ``b_i``
alone (vmap evaluates each example separately: a non-finite value of another example cannot reach
it, as it would through ``0 * nan`` in a product contracted over the batch). ``b_i`` is example
``i``'s own loss gradient because the trace proves the module's outputs row separable (its
operations run under the separability tracer like every other operation) and marks them
``(0, 1)``; an argument whose trace layout is neither constant nor batch-first is refused. Outputs
that hold each example in ``k`` consecutive rows (layout ``(0, k)``: augmentation multiplicity's
K copies) are marked ``(0, k)``, every argument must then be constant or of layout ``(0, k)``, and
example ``i``'s vector is the product at its ``k`` rows (the module evaluated on a batch of ``k``
rows) with its ``k`` rows of ``b``.

Exactness (the sum is the gradient), checked by :func:`check_module_windows`: every use of the
module's parameters must lie inside one of its calls and reach that call's outputs. Autograd nodes
carry sequence numbers; the nodes created during a call lie in the window between the call's
pre-hook and its forward hook. The edges into a parameter's ``AccumulateGrad`` node from the nodes
of those windows that are reachable from the calls' live outputs must be ALL its edges in the graph
(a use outside the module, e.g. ``x * block.scale`` elsewhere, or a tensor derived from the
parameter and kept for later, is refused). What the recomputation cannot reproduce is refused too:
an argument modified in place after the call; a forward that ``vmap`` cannot run one example at a
time (data-dependent Python control flow). Dropout inside such a module draws fresh masks in the
recomputation (``randomness="different"``): the vector is still a function of its example alone.

A refusal raises :class:`PerLayerUnsupported` (the ghost engine turns it into its run-time refusal;
``auto`` then falls back to ``vmap`` and says why).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from dpclip._ident import ident
from dpclip.engine.errors import PerLayerNotProved, PerLayerUnsupported, quote_error
from dpclip.engine.memory_watch import MemoryWatch
from dpclip.engine.proved_program import _written
from dpclip.engine.op_entry import call_op, no_compiled_autograd
from dpclip.engine.separable import MIXED, SeparabilityTracer, _IdMap

__all__ = ["PerLayerNotProved", "PerLayerUnsupported", "RecomputeTracer", "check_module_windows",
           "join_layouts", "module_grads", "output_tensors", "own_param", "replay", "scale_holds",
           "EmbeddingLookup", "embedding_lookup",
           "seq_now", "settle_call"]

_SEQ_LEAF = torch.zeros((), requires_grad=True)




def own_param(mod: Any, role: str) -> Any:
    """The parameter of ``mod`` that an owner's ``role`` names: an attribute of the module, or a
    dotted path to a child's (``out_proj.weight``: ``nn.MultiheadAttention`` reads its child
    Linear's parameters in its own forward, never calling the child, so its call owns them:
    ``ghost._scan``). Read through ``_modules``, not a module's own ``__getattr__``."""
    *path, attr = role.split(".")
    for part in path:
        mod = mod._modules[part]
    return getattr(mod, attr)


def seq_now() -> int:
    """The current autograd sequence number of this thread (a fresh node's number)."""
    with torch.enable_grad():
        return _SEQ_LEAF.view(()).grad_fn._sequence_nr()


def output_tensors(out: Any) -> list[Tensor]:
    """The tensors of a module's output: a tensor, or tuples / lists / dicts (e.g. a Hugging Face
    ``ModelOutput``) of them, in order."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in output_tensors(x)]
    return []


def join_layouts(lays: Sequence[Any]) -> Any:
    """The separability layout that stands for several outputs: the one layout that every
    output that is not constant (``None``) has, else ``None`` if all are constant, else
    :data:`~dpclip.engine.separable.MIXED` (outputs of different layouts: the engine marks every
    batch-first output with the joined layout, so one output that mixes the examples, or holds
    them in other rows, would be marked as the others are; twenty-sixth hostile review: a mixing
    output returned after one of layout ``(0, 2)`` was taken for ``(0, 2)``, LOO 10.8 C at B
    16)."""
    out = None
    for lay in lays:
        if lay is None:
            continue
        if out is None:
            out = lay
        elif lay != out:
            return MIXED
    return out


def _accumulate_var(fn: Any) -> Any:
    return getattr(fn, "variable", None)


def check_module_windows(calls: Sequence[Any], uses: dict[str, int],
                         ruled: dict[str, int], by_param: dict[int, str],
                         indeg: dict[Any, int] | None = None,
                         out_edges: dict[Any, dict[int, int]] | None = None) -> None:
    """Check that the per-layer calls' vector-Jacobian products give the per-example gradients of
    their modules' parameters (module docstring). ``calls``: the live per-layer calls (``outs``,
    ``bs``, ``window``, ``owner``); ``uses``: edges into each parameter's ``AccumulateGrad`` node in
    the whole graph; ``ruled``: the number of ruled layer calls using each parameter (tied with a
    ruled layer); ``by_param``: canonical names by ``ident(param)``; ``indeg``: every node's number
    of incoming edges in the whole graph (an intermediate of a call that depends on its
    parameters and is used after the call, e.g. ``self.hw = self.weight.float()`` read later,
    carries a gradient the call's product misses: refused; sixteenth hostile review, silently
    dropped before); ``out_edges``: for the calls' output nodes, the edges into each of their
    output numbers in the whole graph (another output of a multi-output node used after the call
    is such an intermediate too). Raises :class:`PerLayerUnsupported`."""
    counted: dict[str, int] = dict(ruled)
    for c in calls:
        name = c.owner.name
        start, end = c.window
        if start is None:
            raise PerLayerUnsupported(
                f"the call of module {name!r} ({type(c.mod).__name__}) was not seen entering "
                "(its forward pre-hook did not run); call it through its module")
        own = {ident(own_param(c.mod, r)) for r in c.owner.roles}
        # (an output created outside the call, e.g. an input returned as is, is no use of the
        # module's parameters: its node is not a root)
        roots = [e.node for e, b in zip(c.oedges, c.bs) if b is not None and e.node is not None
                 and start < e.node._sequence_nr() < end]
        seen: set[Any] = set()
        inner: dict[Any, int] = {}  # edges into each node of the call from the call's nodes
        #: (node, output number) -> edges into it from the call's nodes, for its output nodes
        inner_nr: dict[tuple[Any, int], int] = {}
        outs = {e.node for e in c.oedges if e.node is not None}
        below: dict[Any, list[Any]] = {}  # the call's nodes each node leads to
        touches: set[Any] = set()  # nodes with an edge into an own parameter
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            kids = below[node] = []
            for n, nr in node.next_functions:
                if n is None:
                    continue
                if n in outs:
                    inner_nr[(n, nr)] = inner_nr.get((n, nr), 0) + 1
                var = _accumulate_var(n)
                if var is not None:
                    if ident(var) in own:
                        touches.add(node)
                        pn = by_param.get(ident(var))
                        if pn is not None:
                            counted[pn] = counted.get(pn, 0) + 1
                    continue
                if start < n._sequence_nr() < end:  # created by this call
                    inner[n] = inner.get(n, 0) + 1
                    kids.append(n)
                    stack.append(n)
        if indeg is not None:
            escaped = [n for n in seen if n not in outs and indeg.get(n, 0) > inner.get(n, 0)]
            # an output node's other outputs (split, unbind, a multi-output op) used after the
            # call: edges into an output number the call did not return (twenty-second hostile
            # review: the other piece of a split leaked through a global, its gradient dropped)
            returned = {(e.node, e.output_nr) for e in c.oedges if e.node is not None}
            escaped += [n for n in outs if n in seen and any(
                (n, nr) not in returned and count > inner_nr.get((n, nr), 0)
                for nr, count in (out_edges or {}).get(n, {}).items())]
            if escaped and _reaches(escaped, below, touches):
                raise PerLayerUnsupported(
                    f"module {name!r} ({type(c.mod).__name__}, per-layer path): a tensor its call "
                    "computed from its parameters is used after the call (kept in an attribute or "
                    "returned where the module's outputs are not seen): the gradient through "
                    "that use cannot be read from the call; return it, or use engine 'vmap'")
    names = {by_param[ident(own_param(c.mod, r))] for c in calls for r in c.owner.roles
             if ident(own_param(c.mod, r)) in by_param}
    bad = sorted(pn for pn in names if counted.get(pn, 0) != uses.get(pn, 0))
    if bad:
        raise PerLayerUnsupported(
            f"parameter(s) {', '.join(bad)} of per-layer module(s) are used outside the calls of "
            "the modules that own them (e.g. read by another module, or a tensor derived from "
            "them kept for later): their per-example gradient cannot be read from the module's "
            "calls; use the parameter only inside its module's forward, or engine 'vmap'")


def _reaches(starts: list[Any], below: dict[Any, list[Any]], touches: set[Any]) -> bool:
    """Whether a node of ``starts`` leads, through the call's nodes, to an own parameter."""
    seen: set[Any] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node in touches:
            return True
        if node in seen:
            continue
        seen.add(node)
        stack.extend(below.get(node, ()))
    return False


def capture_args(args: tuple, kwargs: dict,
                 mod: Any = None) -> tuple[tuple, dict, list[tuple[Tensor, int]], Any]:
    """The arguments of a per-layer call, with every tensor's version (an in-place change after
    the call would make the recomputation differ from the call: refused), and a snapshot of the
    module's own state (:func:`module_state`)."""
    vers = [(t, t._version) for t in _leaves((args, kwargs))]
    return args, dict(kwargs), vers, None if mod is None else module_state(mod)


def module_state(mod: Any) -> list[tuple[Any, str, int, list[tuple[Tensor, int]]]]:
    """Every tensor a module (and its submodules) holds: parameters, buffers and tensor attributes
    (also inside lists, tuples and dicts), as ``(object, attribute, id of the value, [(tensor,
    version)])``. The recomputation of a per-layer call reads this state AFTER the forward: a
    forward that changes it (a buffer updated in place from the batch, a tensor attribute
    replaced, e.g. ``self.scale = x.mean()``) would let other examples' data into an example's
    vector, so any change is refused (:func:`check_state`)."""
    out = []
    for m in mod.modules():
        for key, val in m.__dict__.items():
            if key == "_modules":
                continue
            if key in ("_parameters", "_buffers"):
                for k, v in val.items():
                    out.append((val, k, ident(v), [(v, v._version)] if isinstance(v, Tensor) else []))
                continue
            leaves = _leaves(val)
            if leaves:
                out.append((m.__dict__, key, ident(val), [(t, t._version) for t in leaves]))
    return out


def check_state(snapshot: Any, mod: Any, name: str) -> None:
    """Raise :class:`PerLayerUnsupported` when the module's state changed since ``snapshot``."""
    now = {(ident(obj), key): (vid, vers) for obj, key, vid, vers in module_state(mod)}
    then = {(ident(obj), key): (vid, vers) for obj, key, vid, vers in snapshot}
    changed = now.keys() != then.keys() or any(
        now[k][0] != then[k][0] or any(t._version != v for t, v in then[k][1]) for k in then)
    if changed:
        raise PerLayerUnsupported(
            f"module {name!r} ({type(mod).__name__}, per-layer path) changed its own state "
            "during the forward (a parameter, buffer or tensor attribute updated or replaced): "
            "its per-example gradient is recomputed from that state after the forward, which "
            "could then carry other examples' data; keep the forward free of state updates, or "
            "use engine 'vmap'")


def _leaves(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _leaves(v)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _leaves(v)]
    return []


def arg_batch_dims(args: tuple, kwargs: dict, layout: Callable[[Tensor], Any], batch: int,
                   group: int = 1, uniform: Callable[[Tensor], bool] | None = None,
                   uniform1: Callable[[Tensor], bool] | None = None) -> list[Any]:
    """For every tensor of the call's arguments (in :func:`_leaves` order): ``0`` when it is sliced
    per example (batch-first: example data, or a constant with ``batch`` rows, which the batched
    call combined row-wise with the examples), ``None`` when it is passed whole (a constant without
    the batch dimension), ``"bad"`` when the trace saw the batch in another dimension or mixed.
    ``group``: rows per example of the call (``batch`` counts rows then), example data must have
    layout ``(0, group)``. ``uniform``: whether a constant with ``batch`` rows is the same for
    every example; one that is not is ``"position"`` (example i's slice would be its position's
    row: thirtieth hostile review, ``arange(B) % 2`` scaled by a parameter, LOO 8.39 C).
    ``uniform1``: the same for a constant with ``batch`` entries in dimension 1 (a recurrent
    layer's initial state ``zeros(layers, B, h)``): ``"const1"`` when it is the same for every
    example, else ``"position1"``; :func:`module_grads` slices it there only where the proof has
    the batch size in that dimension."""
    out: list[Any] = []
    for t in _leaves((args, kwargs)):
        lay = layout(t)
        if lay == (1, group):
            # example data with the batch in dimension 1 (a sequence-first (T, B, d) input of a
            # recurrent layer, an initial state (layers, B, h)): sliced there
            out.append(1)
        elif lay is not None and lay != (0, group):
            out.append("bad")
        elif t.ndim and t.shape[0] == batch:
            first = 0 if lay is not None or uniform is None or uniform(t) else "position"
            if lay is None and uniform1 is not None and t.ndim > 1 and t.shape[1] == batch:
                # both sizes equal the batch size (an (L, B, h) state with L == B): which one is
                # the batch is read from the proof's shapes (:func:`module_grads`), never from
                # the sizes (fifty-sixth hostile review: refused exactly at B == L, which told
                # the batch size)
                out.append(("or", first, "const1" if uniform1(t) else "position1"))
            else:
                out.append(first)
        elif lay is None and uniform1 is not None and t.ndim > 1 and t.shape[1] == batch:
            out.append("const1" if uniform1(t) else "position1")
        else:
            out.append(None)
    return out


def _rebuild(x: Any, it: Any) -> Any:
    """``x`` with its tensors replaced, in :func:`_leaves` order, by the values of ``it``."""
    if isinstance(x, Tensor):
        return next(it)
    if isinstance(x, dict):
        return {k: _rebuild(v, it) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_rebuild(v, it) for v in x) if not hasattr(x, "_fields") else \
            type(x)(*(_rebuild(v, it) for v in x))
    return x


def _examples(t: Tensor, batch: int, group: int, dim: int = 0) -> Tensor:
    """``(batch group, ...) -> (batch, group, ...)``: the rows of each example, which the module is
    evaluated on (a batch of ``group`` rows; of one row, ``(batch, 1, ...)``, for ``group`` 1).
    ``dim`` 1: the examples' entries are in dimension 1, ``(n, batch group, ...) -> (batch, n,
    group, ...)``."""
    if dim:
        return t.unflatten(dim, (batch, group)).movedim(dim, 0)
    return t.reshape(batch, group, *t.shape[1:])


def _is_arg(name: Any, arg_names: dict[Any, int]) -> int | None:
    """The position of the argument leaf that ``name`` (a name of the proved program) stands for,
    or None. An input of the batch is named by its leaf positions, which meet (ProgramMatch._eq)."""
    got = arg_names.get(name)
    if got is not None or name[0] != "in":
        return got
    for n, i in arg_names.items():
        if n[0] == "in" and n[1] & name[1]:
            return i
    return None


def _written_specs(func: Any, a: tuple, kw: dict) -> list[tuple]:
    """The argument specs an operation's schema writes."""
    got = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            spec = kw.get(arg.name) if arg.kwarg_only or i >= len(a) else a[i]
            if spec is not None:
                got.append(spec)
    return got


def settle_call(w: Any, layout: Callable[[Tensor], Any], rows: int) -> None:
    """At the end of a per-layer call (its forward hook): what the replay of its proved operations
    (:class:`~dpclip.engine.proved_program.CallWindow`) may read. Every name it reads must be made
    by the call's own operations, an argument, an own trainable parameter, or a tensor from outside
    the call that carries no example data by the trace (a parameter or buffer of another module, a
    constant of the forward without the batch rows), kept by identity with its version
    (``w.fixed``: an in-place change before the replay is refused). Every operation that writes
    must write a tensor the call made (the replay must not write the model's tensors)."""
    if w.why is not None or w.end is None:
        return
    entries = w.program.entries[w.start:w.end]
    inside = {e[3] for e in entries}
    args = {n: i for i, n in enumerate(w.arg_names) if n is not None}

    def made(name: Any) -> bool:
        return name[0] == "op" and name[1] in inside

    for func, a, kw, _ in entries:
        if func._schema.is_mutable:
            for spec in _written_specs(func, a, kw):
                specs = spec[2] if spec[0] == "l" else (spec,)
                if not all(x[0] == "t" and made(x[1]) for x in specs):
                    w.why = (f"its operation {func._schema.name.split('::')[-1]} writes in place "
                             "a tensor it did not make (an argument, a parameter, a buffer or a "
                             "tensor from outside the call)")
                    return
        for spec in list(a) + list(kw.values()):
            if spec[0] in ("x", "?") or (spec[0] == "l" and any(x[0] in ("x", "?")
                                                                 for x in spec[2])):
                w.why = ("it reads a tensor from outside the model (a global or closure tensor), "
                         "or one the proof could not name")
                return
    for name, t in w.reads.items():
        if made(name) or name in w.own_names or _is_arg(name, args) is not None:
            continue
        state = name[0] in ("p", "b")  # a parameter or buffer of the model (not of the batch)
        # (the proof's shape decides, not the real size: a public (T, d) table read at B == T
        # would otherwise be refused at that batch size only, a side channel: eighteenth review)
        if layout(t) is not None or name[0] == "in" or \
                (not state and w.program.leading_symbolic(name)):
            w.why = ("it reads a tensor of the forward that carries example data and is not one "
                     "of its arguments (a closure or attribute set from the batch)")
            return
        if w.program.symbolic(name):
            # public, but shaped by the batch size elsewhere than in its rows (zeros(1, B, d)):
            # read whole by one example's replay it would carry B_real into it (fourteenth
            # hostile review: a product over the broadcast rows, LOO 3.09 C)
            w.why = ("it reads a tensor of the forward whose shape involves the batch size "
                     "other than as its rows")
            return
        w.fixed[name] = (t, t._version)
    for name in w.out_names:
        if name is None:
            continue  # no matched operation reads it: module_grads requires its gradient None
        if not (made(name) or name in w.own_names or _is_arg(name, args) is not None):
            w.why = "an output of its call is not made by its proved operations"
            return


def _lookup(env: dict[Any, Any], name: Any) -> Any:
    got = env.get(name)
    if got is not None or name[0] != "in":
        return got
    for n, v in env.items():
        if n[0] == "in" and n[1] & name[1]:
            return v
    return None


class _Unreplayable(Exception):
    pass


def _value(spec: tuple, env: dict[Any, Any]) -> Any:
    kind = spec[0]
    if kind == "t":
        got = _lookup(env, spec[1])
        if got is None:
            raise _Unreplayable("an operation reads a tensor the replay does not have")
        return got
    if kind == "v":
        return spec[1]
    if kind == "c":
        return spec[1]
    if kind == "l":
        return spec[1](_value(x, env) for x in spec[2])
    raise _Unreplayable(spec[1] if kind == "?" else "a tensor from outside the model")


def _literals(entries: list[tuple[Any, tuple, dict, int]]) -> list[Tensor]:
    found: list[Tensor] = []

    def walk(spec: tuple) -> None:
        if spec[0] == "c":
            found.append(spec[1])
        elif spec[0] == "l":
            for x in spec[2]:
                walk(x)

    for _, a, kw, _ in entries:
        for spec in list(a) + list(kw.values()):
            walk(spec)
    return found


def _cut(x: Any, key: Any, cut: frozenset[Any] | None) -> Any:
    if not cut:
        return x
    if isinstance(x, Tensor):
        return x.detach() if key in cut else x
    if isinstance(x, (list, tuple)):
        return type(x)(v.detach() if (key, j) in cut and isinstance(v, Tensor) else v
                       for j, v in enumerate(x))
    return x


_VIEW, _RESHAPE = torch.ops.aten.view.default, torch.ops.aten.reshape.default
_SDPA_MATH = torch.ops.aten._scaled_dot_product_attention_math.default
#: fused scaled dot-product attention kernels -> the schema names of their mask (additive bias)
#: argument, or None
_FUSED_SDPA = {getattr(torch.ops.aten, n).default: m for n, m in (
    ("_scaled_dot_product_flash_attention_for_cpu", "attn_mask"),
    ("_scaled_dot_product_flash_attention", None),
    ("_scaled_dot_product_efficient_attention", "attn_bias"),
    ("_scaled_dot_product_cudnn_attention", "attn_bias"),
    ("_scaled_dot_product_fused_attention_overrideable", "attn_bias"),
) if hasattr(torch.ops.aten, n)}


def _as_math_attention(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The arguments of ``_scaled_dot_product_attention_math`` that compute the same attention
    output as the fused kernel call ``func(*args, **kwargs)``, or None for any other operation.
    The replay runs it in the kernel's place: ``torch.func.vmap`` has no batching rule for some
    fused kernels (the CPU flash attention ``nn.MultiheadAttention`` uses without attention
    weights) and evaluates them example by example with ``select`` and ``stack``, which the
    recomputation's trace cannot prove per example; the math form is made of operations it can.
    Only the kernel's output is given (its log-sum-exp and other outputs are the kernel's own
    bookkeeping for its backward: a later read of them fails the replay). Dropout draws fresh
    masks either way (``randomness="different"``)."""
    mask_name = _FUSED_SDPA.get(func, _MISSING_ARG)
    if mask_name is _MISSING_ARG:
        return None
    bound = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    if bound.get("return_debug_mask", False):
        return None
    return ((bound["query"], bound["key"], bound["value"]),
            {"attn_mask": bound.get(mask_name) if mask_name else None,
             "dropout_p": bound.get("dropout_p", 0.0), "is_causal": bound.get("is_causal", False),
             "scale": bound.get("scale")})


_MISSING_ARG = object()


def replay(entries: list[tuple[Any, tuple, dict, int]], grads: Sequence[bool],
           cuts: Sequence[frozenset[Any] | None], env: dict[Any, Any],
           outs: Sequence[Any], shapes: Sequence[list[Any]]) -> tuple[Any, ...]:
    """Run the proved operations ``entries`` (numbers already evaluated) on the tensors ``env``
    (name -> tensor: the call's arguments, own parameters and fixed reads), each in the grad mode
    it ran in and with the arguments the real run read detached (``cuts``) detached; return the
    tensors named ``outs``. No user code runs: ATen operations only. Every output must have the
    shape the proof's tensor has at one example (``shapes``; fourteenth hostile review: a tensor
    read whole with the real batch size in a broadcast dimension made one example's replay a
    product over B rows): the replay is then the proof's program at a batch of one.

    A ``view`` after the last in-place operation runs as ``reshape``: the same values (and
    gradient) whatever the strides. The proof's strides are those of its kernels (the CPU flash
    attention's output, ``(B, H, T, d)`` strided as ``(B, T, H, d)``, made the
    ``permute(2, 0, 1, 3).contiguous().view(...)`` of ``nn.MultiheadAttention`` a view without a
    copy), and ``vmap``'s
    batching can lay the same values out otherwise (its fallback stacks per-example results), so
    the view itself could fail; with no later write, nothing can tell a copy from an alias."""
    last_write = max((j for j, e in enumerate(entries) if e[0]._schema.is_mutable), default=-1)
    for j, ((func, a, kw, index), grad, cut, want) in enumerate(zip(entries, grads, cuts,
                                                                     shapes)):
        args = tuple(_cut(_value(s, env), i, cut) for i, s in enumerate(a))
        kwargs = {k: _cut(_value(s, env), k, cut) for k, s in kw.items()}
        if func is _VIEW and j > last_write:
            func = _RESHAPE
        math_args = _as_math_attention(func, args, kwargs)
        with torch.set_grad_enabled(grad):
            if math_args is not None:  # (its output alone: a read of the others fails)
                out = _SDPA_MATH(*math_args[0], **math_args[1])[0]
            else:
                out = call_op(func, args, kwargs)
        got = [out] if isinstance(out, Tensor) else list(out) if isinstance(out, (tuple, list)) \
            else []
        for j, o in enumerate(got):
            if isinstance(o, Tensor):
                w = want[j] if j < len(want) else None
                if w is None or tuple(o.shape) != w:
                    raise _Unreplayable(
                        f"operation {func._schema.name.split('::')[-1]} gives a tensor of shape "
                        f"{tuple(o.shape)} where the proof's has {w} at one example")
                env[("op", index, j)] = o
    got = []
    for n in outs:
        v = _lookup(env, n)
        if v is None:
            raise _Unreplayable("an output of the call is not made by the replay")
        got.append(v)
    return tuple(got)


def module_grads(c: Any, batch: int) -> dict[str, Tensor]:
    """Per-example gradients ``(B, *param.shape)`` of the module's own trainable parameters from
    one call: ``torch.func.vmap`` over the examples of the vector-Jacobian product of the call's
    PROVED OPERATIONS (:class:`~dpclip.engine.proved_program.CallWindow`: the ATen operations the
    forward ran inside the call, matched against the batch-size proof, their numbers evaluated for
    one example), with the module's own parameters as the variables (its inputs, frozen
    parameters, buffers and children held fixed), at example ``i``'s arguments, with example
    ``i``'s row of the output gradients ``c.bs``.

    The module's Python does not run again: a replay of its Python read whatever the forward kept
    (a Python number such as the realised batch size, in an attribute or a global; thirteenth
    hostile review: LOO 3.13 C), which no tensor check sees. The replay's every number is the
    proof's (a function of the batch size that the proof allowed, evaluated at one example), its
    every tensor an argument row, an own parameter, a tensor it made or a public tensor the call
    read (:func:`settle_call`).

    Each example's product is evaluated on that example alone, so a non-finite value of one
    example cannot reach another's gradient (a batched product through the retained graph would
    contract ``0 * nan`` over the batch). Dropout inside the module draws fresh masks
    (``randomness="different"``): the vector is still a function of the example alone and is the
    very vector whose norm is taken and summed."""
    from torch.func import vjp, vmap

    mod = c.mod
    if c.args is None:
        raise PerLayerUnsupported(
            f"the call of module {c.owner.name!r} ({type(mod).__name__}) was not seen entering "
            "(its forward pre-hook did not run); call it through its module")
    w = c.call
    if w is None or w.end is None:
        raise PerLayerNotProved(
            f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path): its call was not "
            "matched against the step's proved program, so its per-example gradients cannot be "
            "replayed from proved operations; use engine 'vmap'")
    args, kwargs, vers, state = c.args
    if state is not None:
        check_state(state, mod, c.owner.name)
    if w.why is not None:
        raise PerLayerUnsupported(
            f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path): its per-example "
            f"gradients are replayed from the call's proved operations, and {w.why}; use engine "
            "'vmap'")
    for t, v in vers + list(w.fixed.values()):
        if t._version != v:
            raise PerLayerUnsupported(
                f"an argument of module {c.owner.name!r} ({type(mod).__name__}, per-layer path), "
                "or a tensor its forward read, was modified in place after the call (e.g. "
                "x.mul_(2) on a tensor the module consumed); use out-of-place operations")
    prog = w.program
    dims = list(c.arg_dims)
    for k, d in enumerate(dims):  # (arg_batch_dims: both sizes the batch size's)
        if isinstance(d, tuple) and d[0] == "or":
            n = w.arg_names[k]
            one = n is not None and n[0] == "op" and not prog.leading_symbolic(n) and \
                prog.symbolic_at(n, 1)
            dims[k] = d[2] if one else d[1]
    # (a constant whose rows differ: refused below if the proof has it sliced per example)
    position = {k for k, d in enumerate(dims) if d == "position"}
    dims = [0 if d == "position" else d for d in dims]
    if any(d == "bad" for d in dims):
        raise PerLayerUnsupported(
            f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path) was called on a "
            "tensor with the batch in a dimension other than 0; give it batch-first inputs")
    for k, n in enumerate(w.arg_names):
        # sliced per example only where the proof has the batch as its rows: a parameter or buffer
        # never, an operation's output where the proof's first size involves the batch (fifteenth
        # hostile review: a public (T, d) buffer passed as an argument was sliced when T equalled
        # the batch size, so one example's replay read one row of it: LOO 3.55 C)
        if n is not None and n[0] in ("p", "b"):
            dims[k] = None if dims[k] != 1 else "bad"
        elif n is not None and n[0] == "op":
            if dims[k] == 1:  # example data in dimension 1: the proof must have the batch there
                dims[k] = 1 if prog.symbolic_at(n, 1) else "bad"
            elif prog.leading_symbolic(n):
                dims[k] = 0
            elif dims[k] in ("const1", "position1") and prog.symbolic_at(n, 1):
                # a constant with the batch in dimension 1 (an RNN's zeros initial state): each
                # example's replay reads its own entries, the same for everyone (checked)
                if dims[k] == "position1":
                    raise PerLayerUnsupported(
                        f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path) was "
                        "called on a constant with one entry per example in dimension 1 whose "
                        "entries differ: each example's gradient would depend on its position "
                        "in the batch; give every example the same constant")
                dims[k] = 1
            else:
                dims[k] = None
        elif dims[k] in ("const1", "position1"):
            dims[k] = None
        elif dims[k] == 1:  # (only an operation's output, with the proof's shape checked)
            dims[k] = "bad"
    if any(d == "bad" for d in dims):
        raise PerLayerUnsupported(
            f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path) was called on a "
            "tensor with the batch in dimension 1 that the proof does not have there")
    if any(dims[k] == 0 for k in position):
        raise PerLayerUnsupported(
            f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path) was called on a "
            "constant with one row per example whose rows differ (e.g. built from "
            "torch.arange(batch size)): each example's gradient would depend on its position "
            "in the batch; give every example the same constant (expand one row)")
    leaves = [t for t, _ in vers]
    group = c.group  # rows per example: each example is evaluated on its own rows
    batched = [_examples(t, batch, group, d) for t, d in zip(leaves, dims) if d in (0, 1)]
    fixed = {k: t for k, (t, d) in enumerate(zip(leaves, dims)) if d not in (0, 1)}
    own = {r: own_param(mod, r) for r in c.owner.roles}
    # (each output's examples where the trace put them: dimension 0, or 1 for an RNN's states)
    bs = [_examples(b if b is not None else torch.zeros_like(t), batch, group, d or 0)
          for t, b, d in zip(c.outs, c.bs, c.batch_first)]
    entries = prog.at(1)[w.start:w.end]  # the proof's numbers for one example
    shapes = [[prog.shape(("op", e[3], j), 1) for j in range(len(prog.shapes.get(e[3], ())))]
              for e in entries]
    for n, (t, d) in zip(w.arg_names, zip(leaves, dims)):
        want = None if n is None else prog.shape(n, 1)
        have = tuple(t.shape)
        if d in (0, 1):
            have = have[:d] + (group,) + have[d + 1:]
        if n is not None and n[0] == "op" and want != tuple(have):
            raise PerLayerUnsupported(
                f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path): an argument of "
                f"shape {tuple(t.shape)} has shape {want} in the proof at one example (its shape "
                "involves the batch size other than as its rows); pass it batch-first, or use "
                "engine 'vmap'")
    grads, cuts = list(w.grad), list(w.cuts)
    arg_at = [(n, i) for i, n in enumerate(w.arg_names) if n is not None]
    reads = {n: t for n, (t, _) in w.fixed.items()}
    own_at = list(w.own_names.items())
    # an output the proof does not make (its operation was dead code there: an RNN's final
    # states the loss never reads) is read by no matched operation, so no gradient reaches it;
    # it is left out of the replay only when the backward confirms that (its b is None)
    if any(n is None and b is not None for n, b in zip(w.out_names, c.bs)):
        raise PerLayerUnsupported(
            f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path): an output of its "
            "call is not made by its proved operations, and the loss depends on it; use "
            "engine 'vmap'")
    keep = [j for j, n in enumerate(w.out_names) if n is not None]
    outs = [w.out_names[j] for j in keep]
    bs = [bs[j] for j in keep]

    def one(rows: list[Tensor], b_rows: list[Tensor]) -> dict[str, Tensor]:
        rit = iter(rows)
        vals = [fixed[k] if k in fixed else next(rit) for k in range(len(leaves))]

        def f(p: dict[str, Tensor]) -> tuple[Tensor, ...]:
            env: dict[Any, Any] = dict(reads)
            for n, i in arg_at:
                env[n] = vals[i]
            for n, r in own_at:
                env[n] = p[r]
            return replay(entries, grads, cuts, env, outs, shapes)

        with no_compiled_autograd():
            _, back = vjp(f, own)
            return back(tuple(b_rows))[0]

    allowed = list(fixed.values()) + [t for _, _, _, vs in module_state(mod) for t, _ in vs] + \
        list(reads.values()) + _literals(entries)
    tracer = RecomputeTracer(batch, allowed + list(own.values()))
    for t in batched + bs:
        tracer.mark(t, (0, 1))
    try:
        with torch.enable_grad(), tracer:
            got = vmap(one, randomness="different")(batched, bs)
    except _Unreplayable as exc:
        raise PerLayerUnsupported(
            f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path): its proved "
            f"operations cannot be replayed for one example ({exc}); use engine 'vmap'") from None
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise PerLayerUnsupported(
            f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path): its proved "
            "operations cannot be evaluated one example at a time by torch.func.vmap "
            f"({quote_error(exc)}); use engine 'vmap'") from None
    finally:
        tracer.retire()  # what the recomputation left behind is this batch's data
    why = tracer.verdict([got[r] for r in c.owner.roles])
    if why is not None:
        raise PerLayerNotProved(
            f"module {c.owner.name!r} ({type(mod).__name__}, per-layer path): its per-example "
            f"replay under torch.func.vmap is not proved to read example i alone ({why}); "
            "use engine 'vmap'")
    return {r: got[r].detach() for r in c.owner.roles}


def _plain_number(v: Any) -> bool:
    return type(v) in (int, float, bool)


def _rows_put_own(tr: Any, args: tuple, b: int) -> bool:
    """Whether ``index_put(self, indices, values, ...)`` writes into row ``i`` of ``self`` only
    values of row ``i``: the first index is every position's own row (``arange(b)`` broadcast,
    checked by value), the other indices and the values are constants or example data with the
    batch first, aligned with the first index, and ``self`` is a constant or example data
    (``torch.func.vmap``'s batching of ``weight[ids]``'s gradient)."""
    if len(args) < 3 or not isinstance(args[0], Tensor) or not isinstance(args[1], (list, tuple)):
        return False
    dest, indices, values = args[0], list(args[1]), args[2]
    if not indices or not all(isinstance(t, Tensor) for t in indices) or \
            not isinstance(values, Tensor) or dest.ndim < len(indices) or dest.shape[0] != b:
        return False
    rows = indices[0]
    if rows.is_floating_point() or rows.dtype == torch.bool or rows.ndim == 0 or \
            rows.shape[0] != b or tr.layout(rows) is not None:
        return False
    own = torch.arange(b, device=rows.device, dtype=rows.dtype).view(b, *[1] * (rows.ndim - 1))
    if not torch.equal(rows, own.expand_as(rows)):
        return False
    for t in indices[1:]:
        lay = tr.layout(t)
        if t.is_floating_point() or t.dtype == torch.bool or \
                (lay is not None and (lay != (0, 1) or t.ndim != rows.ndim or t.shape[0] != b)):
            return False
    try:
        index_shape = torch.broadcast_shapes(*(tuple(t.shape) for t in indices))
    except RuntimeError:
        return False
    if len(index_shape) != rows.ndim or index_shape[0] != b:
        return False
    lay = tr.layout(values)
    if lay is not None and (lay != (0, 1) or values.shape[0] != b or
                            values.ndim != len(index_shape) + dest.ndim - len(indices)):
        return False
    return tr.layout(dest) in (None, (0, 1))


def _block_offsets(off: Any, b: int) -> int | None:
    """``V`` when ``off`` is ``arange(0, b V, V)`` shaped ``(b, 1, ..., 1)`` (integers, ``V > 0``),
    else None."""
    if not isinstance(off, Tensor) or off.is_floating_point() or off.is_complex() or \
            off.dtype == torch.bool or tuple(off.shape) != (b,) + (1,) * (off.ndim - 1):
        return None
    flat = off.reshape(b)
    v = int(flat[1]) - int(flat[0])
    if v <= 0 or not torch.equal(flat, torch.arange(0, b * v, v, dtype=off.dtype,
                                                     device=off.device)):
        return None
    return v


class RecomputeTracer(SeparabilityTracer):
    """The separability tracer around a per-layer recomputation (:func:`module_grads`; third
    hostile review: the recomputation runs the module's forward again, under ``torch.func.vmap``,
    where it can tell functorch's tensors from real ones and read a global copy of the real batch:
    accepted before, LOO 1.06 C).

    The operations ``vmap`` runs reach the tracer's dispatch mode on the batched tensors (its
    batching rules applied), so the layout rules see a reduction over the examples as they do in
    the forward. On top of the forward's rules, and because no proved program is matched here:

    * every tensor argument must be known: marked (the batched arguments and output gradients),
      allowed (the module's parameters, buffers and tensor attributes, its arguments without the
      batch), or made by an operation this tracer saw. A tensor computed with Python dispatch
      switched off, or any other tensor from outside, is refused (a module reading a global
      constant tensor is refused too: conservative);
    * every allowed tensor and every tensor the recomputation makes is watched by value
      (:class:`~dpclip.engine.memory_watch.MemoryWatch`, as the forward's match): a write no
      operation shows, its version counter set back, is refused;
    * the per-example gradients it returns must have the layout ``(0, 1)``.

    One batching rule of ``vmap`` is recognised as a whole (:meth:`_embedding_blocks`): the
    gradient of an embedding lookup (``F.embedding`` in a module on this path: Gemma's scaled word
    embedding, a custom embedding wrapper) is batched by offsetting example ``i``'s indices by
    ``i V`` (``arange(0, B V, V)``) and running ONE ``embedding_dense_backward`` over ``B V`` rows,
    then viewed as ``(B, V, d)``. The offset indices depend on the example's position (refused as
    such), but with every index in ``[0, V)`` (checked) example ``i``'s rows land in block ``i``
    only: the backward's output has layout ``(0, V)`` (``V`` rows per example), and the view makes
    it ``(0, 1)``. Any other use of the offset indices stays mixing."""

    def __init__(self, batch: int, allowed: Sequence[Tensor]) -> None:
        super().__init__(batch)
        #: indices offset by ``arange(0, B V, V)`` (example ``i``'s in block ``i``) -> ``(V,
        #: their version)``: :meth:`_embedding_blocks`
        self._blocked = _IdMap()
        #: the backward's outputs (-> V), their (B, V, d) views (-> V), and the padding rows of
        #: those views (-> (view, version)): F.embedding's padding_idx under vmap
        self._block_outs = _IdMap()
        self._block_views = _IdMap()
        self._pad_rows = _IdMap()
        self._known = _IdMap()
        for t in allowed:
            self._known[t] = True
        self.unknown: str | None = None
        self.watch = MemoryWatch()
        self.watch.add((t, "a tensor of the module") for t in allowed)

    def mark(self, t: Tensor, layout: Any) -> None:
        super().mark(t, layout)
        self._known[t] = True
        self.watch.add(((t, "an argument of the recomputation"),))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.quiet:
            if self.unknown is None:
                for t in _leaves((args, kwargs)):
                    if t not in self._known:
                        self.unknown = (f"{func._schema.name.split('::')[-1]} reads a "
                                        f"{tuple(t.shape)} tensor that the recomputation did not "
                                        "make and that is not the module's")
                        break
            self.watch.check_args(args, kwargs, func)
        pad = not self.quiet and self._pad_write(func, args)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not self.quiet:
            self._embedding_blocks(func, args, kwargs, out, pad)
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(o, Tensor)]
            for o in outs:
                self._known[o] = True
            self.watch.refresh(_written(func, args, kwargs))
            self.watch.add((o, "a tensor the recomputation made") for o in outs)
        return out

    def _pad_write(self, func: Any, args: tuple) -> bool:
        """Whether ``func`` sets a padding row of an embedding's per-example blocks to a constant
        (:meth:`_embedding_blocks`), both the row and its blocks still of layout ``(0, 1)`` and
        their storage written by nothing else the tracer saw (checked before the write)."""
        aten = torch.ops.aten
        if func not in (aten.fill_.Scalar, aten.zero_.default) or not args or \
                not isinstance(args[0], Tensor) or args[0] not in self._pad_rows:
            return False
        if func is aten.fill_.Scalar and not (len(args) == 2 and _plain_number(args[1])):
            return False
        row = args[0]
        base = self._pad_rows[row]
        with torch._C.DisableTorchFunction():
            ptr = row.untyped_storage().data_ptr()
            return self.layout(row) == (0, 1) and self.layout(base) == (0, 1) and \
                ptr not in self._taint and ptr not in self._mixed_in_place and \
                base.untyped_storage().data_ptr() == ptr

    def _embedding_blocks(self, func: Any, args: tuple, kwargs: dict, out: Any,
                          pad: bool = False) -> None:
        """``vmap``'s batching of an embedding's backward (class docstring). The offsets are
        checked by value (``arange(0, B V, V)`` as ``(B, 1, ..., 1)``), the indices they are added
        to must be example data with layout ``(0, 1)`` and lie in ``[0, V)``, and the offset
        indices must reach the backward unchanged (same version; the watch sees unseen writes);
        the layout of the backward's output is set here, everything else keeps the tracer's."""
        b = self.batch
        aten = torch.ops.aten
        if not isinstance(out, Tensor) or b < 2:
            return
        with torch._C.DisableTorchFunction():
            if func is aten.add.Tensor and len(args) == 2 and kwargs.get("alpha", 1) == 1:
                for idx, off in (args, args[::-1]):
                    v = _block_offsets(off, b)
                    if v is not None and isinstance(idx, Tensor) and idx.dtype == off.dtype \
                            and self.layout(idx) == (0, 1) and idx.ndim == off.ndim \
                            and idx.shape[0] == b and tuple(out.shape) == tuple(idx.shape) \
                            and idx.numel() > 0 and bool(idx.min() >= 0) \
                            and bool(idx.max() < v):
                        self._blocked[out] = (v, out._version)
                        return
            elif func is aten.view.default and args[0] in self._block_outs:
                if self.layout(out) == (0, 1) and out.ndim == 3 and out.shape[0] == b and \
                        out.shape[1] == self._block_outs[args[0]]:
                    self._block_views[out] = out.shape[1]
            elif func is aten.select.int and len(args) == 3 and args[0] in self._block_views \
                    and args[1] == 1 and self.layout(out) == (0, 1):
                self._pad_rows[out] = args[0]
            elif pad:
                # the padding row of every example's block set to a constant (F.embedding's
                # padding_idx under vmap): each block still depends on its example alone; the
                # tracer took the partial write for a mix of the storage's other views
                base = self._pad_rows[args[0]]
                self._layouts[args[0]] = (0, 1)
                ptr = args[0].untyped_storage().data_ptr()
                if self._taint.get(ptr) == ident(args[0]):
                    del self._taint[ptr]
                self._mixed_in_place.discard(ptr)
                self._layouts[base] = (0, 1)
            elif func in (aten.index_put.default, aten.index_put_.default) and \
                    _rows_put_own(self, args, b):
                # vmap's batching of an index's gradient (weight[ids] in the module): zeros
                # (B, V, d), then out[arange(B), ids] += values: row i receives row i's alone
                self.mark(out, (0, 1))
                if func is aten.index_put_.default:
                    self.mark(args[0], (0, 1))
            elif func is aten.embedding_dense_backward.default and len(args) >= 5:
                grad, idx, num_weights, padding_idx, by_freq = args[:5]
                got = self._blocked[idx] if isinstance(idx, Tensor) and idx in self._blocked \
                    else None
                if got is not None and got[1] == idx._version and num_weights == b * got[0] \
                        and padding_idx == -1 and by_freq is False and isinstance(grad, Tensor) \
                        and self.layout(grad) == (0, 1) \
                        and tuple(grad.shape[:idx.ndim]) == tuple(idx.shape) \
                        and tuple(out.shape[:1]) == (b * got[0],):
                    self.mark(out, (0, got[0]))
                    self._block_outs[out] = got[0]

    def verdict(self, got: Sequence[Tensor]) -> str | None:
        """Why the recomputation is not proved per-example, or None."""
        changed = self.watch.finish()
        if self.violation is not None:
            return self.violation
        if self.unknown is not None:
            return self.unknown
        if changed is not None:
            return f"the memory of {changed} was written by no operation the trace sees"
        for g in got:
            lay = self.layout(g)
            if lay is None and not bool(g.detach().any()):
                continue  # a parameter the call does not use: zero for every example, no data
            if lay != (0, 1):
                first = f", first mixing operation: {self.mixers[0]}" if self.mixers else ""
                return f"its per-example gradients have layout {lay!r}, not (0, 1){first}"
        return None


# ------------------------------------------------- elementwise scales (RMSNorm-like modules)


def _derivative_one_chain(node: Any, param: Tensor) -> bool:
    """Whether the autograd chain from ``node`` down to ``param`` is made only of operations whose
    derivative with respect to their one non-constant input is the identity: dtype casts
    (``param.float()``) and additions of a constant (``1.0 + param``, Gemma's norms)."""
    while node is not None:
        var = _accumulate_var(node)
        if var is not None:
            return var is param
        name = type(node).__name__
        edges = [e for e in node.next_functions]
        if name == "ToCopyBackward0" or name == "AddBackward1":
            node = edges[0][0]
        elif name == "AddBackward0" and len(edges) == 2:
            live = [k for k, (n, _) in enumerate(edges) if n is not None]
            if len(live) != 1 or (live[0] == 1 and getattr(node, "_saved_alpha", 1) != 1):
                return False
            node = edges[live[0]][0]
        else:
            return False
    return False


def _uses_param(root: Any, param: Tensor, start: int | None, end: int) -> bool:
    """Whether ``param`` is reached from ``root`` through nodes created in the window."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = _accumulate_var(node)
        if var is not None:
            if var is param:
                return True
            continue
        if start is not None and not start < node._sequence_nr() < end:
            continue
        stack.extend(n for n, _ in node.next_functions)
    return False


def elementwise_scale(out: Tensor, param: Tensor, window: tuple[int | None, int]
                      ) -> tuple[Tensor, torch.dtype, Tensor] | None:
    """Recognise an RMSNorm-like call by what it computes: ``out = y * h(param)`` with ``param`` a
    vector of the output's last width acting elementwise on the last dimension, ``h`` a chain of
    casts and constant additions (derivative 1: LlamaRMSNorm, T5LayerNorm, Qwen/Mistral norms
    ``weight * y``, Gemma's ``y * (1 + weight.float())``), ``y`` of the output's shape and free of
    ``param``, possibly followed by a cast of the product. Read from the call's autograd graph
    (the ``MulBackward0`` node and its saved operands), not from the class name. Returns ``y``,
    the product's dtype (the per-example gradient is then ``sum over positions of b * y`` in that
    dtype, as autograd forms it) and ``h(param)``, or None when the call does not fit (it then
    takes the general per-layer path). The caller checks :func:`scale_holds`."""
    if param.ndim != 1 or out.ndim < 2 or out.shape[-1] != param.shape[0]:
        return None
    node = out.grad_fn  # (called from the forward hook: the module's own output node)
    while node is not None and type(node).__name__ == "ToCopyBackward0":
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ != "MulBackward0":
        return None
    edges = node.next_functions
    try:
        saved = (node._saved_self, node._saved_other)
    except (AttributeError, RuntimeError):
        return None
    sides = [k for k in (0, 1) if _derivative_one_chain(edges[k][0], param)]
    if len(sides) != 1:
        return None
    k = sides[0]
    y, hw = saved[1 - k], saved[k]
    if hw is None or y is None or tuple(hw.shape) != tuple(param.shape) \
            or tuple(y.shape) != tuple(out.shape):
        return None
    if _uses_param(edges[1 - k][0], param, window[0], window[1]):
        return None
    return y, torch.promote_types(y.dtype, hw.dtype), hw


class EmbeddingLookup:
    """A per-layer call recognised as an embedding lookup of its module's own weight, possibly
    scaled by a constant (BART's and Gemma's scaled word embeddings: ``super().forward(ids) *
    embed_scale``): ``out = E[ids] * s``. Its per-example gradients are then the Embedding rule's
    (ghost norms from the ids, ``index_add`` of the weighted output gradients), with the output
    gradient ``b * s`` as autograd forms it: nothing of shape ``(B, V, d)`` is formed, where the
    replay under ``vmap`` formed the whole per-example table (at BART-base size, 38.6 M floats an
    example). See :func:`embedding_lookup`."""

    __slots__ = ("ids", "scale", "versions")

    def __init__(self, ids: Tensor, scale: Tensor | None) -> None:
        self.ids = ids
        self.scale = scale
        self.versions = (ids._version, None if scale is None else scale._version)

    def operands(self) -> list[Tensor]:
        """What the rule reads after the forward (fingerprinted: ghost_forward._printed)."""
        return [self.ids] + ([] if self.scale is None else [self.scale])

    def unchanged(self) -> bool:
        return (self.ids._version, None if self.scale is None else self.scale._version) \
            == self.versions


#: what the Embedding rule reads of its layer, and the attribute hooks that would answer reads
EMBEDDING_READS = ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                   "scale_grad_by_freq", "sparse", "weight", "__getattr__", "__getattribute__",
                   "__setattr__", "__class__", "__dict__")


def embedding_class_defines(mod: nn.Module) -> str | None:
    """Which class of ``mod``'s, other than ``nn.Embedding``, ``nn.Module`` and ``object``,
    defines something the Embedding rule reads (:data:`EMBEDDING_READS`), or None. Anywhere in the
    MRO: a mixin AFTER ``nn.Module`` defined a ``num_embeddings`` property whose setter kept the
    true value in the instance's dictionary (what the checks read) and whose getter answered the
    reduction's two reads differently (V - 1, then V), so one example's rows were keyed into the
    next example's norm and released with the first's weight: 42 C under compiled, auto, ghost
    and make_private (hundred-and-seventy-fourth hostile review)."""
    for c in type(mod).__mro__:
        if c is nn.Embedding or c is nn.Module or c is object:
            continue
        own = vars(c)
        hit = [k for k in EMBEDDING_READS if k in own]
        if hit:
            return f"its class {c.__name__} defines {hit[0]}"
    return None


def embedding_lookup(out: Tensor, mod: nn.Module, param: Tensor,
                     arguments: Sequence[Tensor]) -> EmbeddingLookup | None:
    """Recognise ``out = F.embedding(ids, mod.weight) [* s]`` from the call's autograd graph: the
    output's node an ``EmbeddingBackward0`` of ``param`` (``mod.weight`` of an ``nn.Embedding``
    without ``max_norm``, ``sparse`` or ``scale_grad_by_freq``, its padding index the module's),
    or a ``MulBackward0`` of that node by a 0-dim constant ``s`` (no gradient; a Python number or a
    buffer); ``ids`` one of the call's own tensor arguments (its version and fingerprint are
    checked with the arguments'); no cast. Anything else: None (the replay). That the parameter
    reaches the loss through the call's output only is :func:`check_module_windows`' check."""
    if not isinstance(mod, nn.Embedding) or embedding_class_defines(mod) is not None:
        # (a class of its MRO with a property over what the Embedding rule reads: the replay;
        # hundred-and-seventy-fourth hostile review)
        return None
    if param is not mod.weight or mod.max_norm is not None \
            or mod.sparse or mod.scale_grad_by_freq or out.dtype != param.dtype:
        return None
    node = out.grad_fn
    scale = None
    if node is not None and type(node).__name__ == "MulBackward0":
        edges = node.next_functions
        live = [k for k, (n, _) in enumerate(edges) if n is not None]
        if len(edges) != 2 or len(live) != 1:
            return None
        try:
            scale = node._saved_other if live[0] == 0 else node._saved_self
        except (AttributeError, RuntimeError):
            return None
        if not isinstance(scale, Tensor) or scale.ndim != 0 or scale.requires_grad or \
                scale.is_complex() or scale.dtype == torch.bool:
            return None
        node = edges[live[0]][0]
    if node is None or type(node).__name__ != "EmbeddingBackward0" or \
            len(node.next_functions) != 1 or _accumulate_var(node.next_functions[0][0]) is not param:
        return None
    try:
        ids, pad = node._saved_indices, node._saved_padding_idx
        freq, sparse = node._saved_scale_grad_by_freq, node._saved_sparse
    except (AttributeError, RuntimeError):
        return None
    if isinstance(pad, int) and pad >= 2 ** 63:  # (read back as an unsigned 64-bit -1)
        pad -= 2 ** 64
    # a negative padding index means none to ATen (every row gets its gradient), where the rule
    # reads the module's as F.embedding does (V + p): only None and non-negative indices agree
    # (a direct torch.embedding with padding_idx -3: row V - 3 zeroed, sixty-second review)
    if mod.padding_idx is not None and mod.padding_idx < 0:
        return None
    if freq or sparse or pad != (-1 if mod.padding_idx is None else mod.padding_idx):
        return None
    # (autograd unpacks a saved input as a new Python tensor on the same memory: the argument
    # itself, the same elements, is what the rule reads)
    same = [t for t in arguments if t.dtype == ids.dtype and t.device == ids.device
            and t.shape == ids.shape and t.stride() == ids.stride()
            and t.untyped_storage().data_ptr() == ids.untyped_storage().data_ptr()
            and t.storage_offset() == ids.storage_offset() and t._version == ids._version]
    return EmbeddingLookup(same[0], scale) if len(same) == 1 else None


def scale_holds(got: tuple[Tensor, torch.dtype, Tensor], call: Any) -> bool:
    """Whether a recognised scale's saved operand ``y`` still holds what the product read: no
    operation of the call wrote its storage (``call``: the call's
    :class:`~dpclip.engine.proved_program.CallWindow`; a write with dispatch off is the memory
    watch's, ``y`` being saved for the backward). A write through a ``set_`` alias, which has its
    own version counter, left ``y`` mixing the batch while the output stayed row separable
    (sixteenth hostile review: LOO 9.82 C); such a call takes the general per-layer path, whose
    replay refuses the write."""
    from dpclip.engine.proved_program import storage_key

    if call is None or call.why is not None:
        return False
    return storage_key(got[0]) not in call.written


def scale_grads(c: Any, batch: int) -> dict[str, Tensor]:
    """Per-example gradients of a recognised elementwise scale: ``sum_t b_t * y_t`` per example
    (each example's own rows only)."""
    (b,) = [b for b in c.bs if b is not None] or [torch.zeros_like(c.outs[0])]
    y, dt, version = c.fast
    if y._version != version:  # changed in place after the call (it may then mix examples)
        raise PerLayerUnsupported(
            f"the saved operand of module {c.owner.name!r} ({type(c.mod).__name__}, per-layer "
            "path) was modified in place after the call; use out-of-place operations")
    p = own_param(c.mod, c.owner.roles[0])
    d = p.shape[0]
    g = (b.to(dt) * y.to(dt)).reshape(batch, -1, d).sum(1)
    return {c.owner.roles[0]: g.to(p.dtype)}
