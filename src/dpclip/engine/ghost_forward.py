"""The ghost engine's forward pass: the hooked (or plain-chain) forward that records each ruled
layer's call, and the separability proof around it (:class:`~dpclip.engine.separable.SeparabilityTracer`
on every step, :func:`~dpclip.engine.batch_symbol.batch_size_uses` once per signature; the
batch-less calls of :mod:`dpclip.engine.batchless`). Where the proof cannot see, the answer is
"not proven": :class:`_RuntimeUnsupported`, which ``auto`` turns into a recorded vmap fallback
when it is met on its public probe batch (and into a stop on a private step after it).
"""

from __future__ import annotations
import collections
from dpclip.engine import _cm
import gc
import os
from typing import Any, Callable
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from dpclip._ident import ident
from dpclip.engine.base import LossFn
from dpclip.engine.batch import batch_leaves, call_model
from dpclip.engine.batch_symbol import data_independent_paths, proof_of
from dpclip.engine.errors import UnsupportedModelError, quote_error
from dpclip.engine.compiled import CompiledUnsupported, _autocast_on as autocast_on, plan_of
from dpclip.engine.batchless import (
    BroadcastGuard,
    NotBroadcast,
    expand_rows,
    is_batchless,
    is_unbatched,
)
from dpclip.engine.proved_program import ProgramMatch, ProvedProgram, describe
from dpclip.engine.saved_check import fingerprints
from dpclip.engine.library_code import library_changed
from dpclip.engine.known_losses import known_loss, known_loss_fn
from dpclip.engine.plain_module import (
    ambient_user_code,
    global_hooks_clear,
    instance_code,
    plain_instance,
    python_callbacks,
)
from dpclip.engine.separable import SeparabilityTracer, uniform_along
from dpclip.registry import KNOWN_PROGRAMS
from torch._subclasses.fake_tensor import is_fake
from dpclip.engine.generators import OwnGenerators
from dpclip.engine.ghost_rules import REWRITTEN, _Call, _MODULE, _Owner, _Scan, layer_config


class _RuntimeUnsupported(Exception):
    """A model property found during the forward pass that the ghost rules cannot handle."""


class _NotTheProvedProgram(_RuntimeUnsupported):
    """The real run is not the program the batch-size proof traced
    (:mod:`dpclip.engine.proved_program`). Never turned into a vmap fallback: whether a run
    matches can depend on the realised batch size (a program built to coincide with the proof at
    one size), so a fallback would choose the engine, and with it the per-example function, from
    the private batch size."""


def _check_losses(losses: Tensor, batch: int) -> Tensor:
    if losses.ndim == 0 or losses.shape[0] != batch:
        from dpclip.engine.errors import loss_shape_error

        raise loss_shape_error(losses.ndim)
    return losses.reshape(batch, -1).sum(1) if losses.ndim > 1 else losses


_module_mod = torch.nn.modules.module


_TABLE_TYPES = (dict, collections.OrderedDict)


def _no_hooks(mod: nn.Module) -> bool:
    """No hooks on ``mod``: its hook tables of their exact types (a dict subclass can hide its
    hooks from a truth test and not from ``Module.__call__``) and empty."""
    tables = (mod._forward_hooks, mod._forward_pre_hooks, mod._backward_hooks,
              mod._backward_pre_hooks)
    return all(type(t) in (dict, collections.OrderedDict) and not len(t) for t in tables)


def _plain_chain(model: nn.Module, by_module: dict[int, "_Owner"]) -> list[nn.Module] | None:
    """The modules that ``model(x)`` applies one after the other, when ``model`` is a plain chain:
    an ``nn.Sequential`` (exactly that type, nested ones flattened) of leaf modules, without hooks
    on the containers or on the layers that own trainable parameters, and no global module hooks.
    Then running the chain ourselves sees every owner call with its input and output exactly as
    forward hooks would, at a fraction of the cost (hooks put every call of a hooked module on
    PyTorch's slow path). ``None``: use hooks."""
    if type(model) is not nn.Sequential or not _no_hooks(model) or not plain_instance(model):
        return None
    if not global_hooks_clear():
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
            if not _no_hooks(mod) or not plain_instance(mod):
                return None
            stack.append(iter(mod._modules.values()))
        elif type(mod._modules) is not dict or mod._modules:  # another container: its own
            return None  # business
        elif ident(mod) in by_module and (not _no_hooks(mod) or by_module[ident(mod)].rule is _MODULE
                                       or instance_code(mod) is not None):
            return None
        else:
            chain.append(mod)
    return chain


_END = object()


def _engine_call(owner: "_Owner", a: Tensor, out: Tensor,
                 tracer: SeparabilityTracer | None) -> _Call:
    """A :class:`_Call` recorded from inside the traced forward: the engine's own code (it reads
    ``grad_fn`` for the gradient edge) is not user code, so the tracer's Python checks pause."""
    # (a step the trace already refuses keeps the trace's more precise message)
    if owner.config is not None and (tracer is None or tracer.violation is None) and \
            layer_config(owner.module) != owner.config:
        raise _NotTheProvedProgram(
            f"layer {owner.name!r} ({type(owner.module).__name__}) ran with another configuration "
            "(padding, stride, eps, ..., or a parameter or buffer swapped or written, in the "
            "forward) than it had when the step started: "
            "its rule reads the per-example gradient as the configuration is after the backward "
            "and is checked for it when the step starts. Configure layers outside the step")
    if tracer is None:  # (a chain whose layouts are cached: _chain_call)
        return _Call(owner, a, out, None)
    quiet, tracer.quiet = tracer.quiet, True
    try:
        return _printed(_Call(owner, a, out, tracer))
    finally:
        tracer.quiet = quiet


def _printed(c: _Call) -> _Call:
    """``c`` with the fingerprints of the tensors the engine reads after the forward (user code
    runs after the call and could rewrite them without a trace: :mod:`dpclip.engine.saved_check`):
    a ruled layer's input; a per-layer call's arguments and its recognised scale's operand
    (third hostile review: rewritten, LOO 1.57 / 1.56 C). The copies are needed although the
    match's memory watch compares the same bytes when the loss returns: user code can run after
    that (the ``__del__`` of an object the engine drops, twentieth hostile review)."""
    if c.outs is None:
        kept = [c.a] if isinstance(c.a, Tensor) else []
    else:
        kept = [t for t, _ in c.args[2]] if c.args is not None else []
        if c.call is not None:  # the tensors its replay reads from outside the call
            kept += [t for t, _ in c.call.fixed.values()]
        if isinstance(c.fast, tuple):  # (an elementwise scale's operand)
            kept.append(c.fast[0])
        elif c.fast is not None:  # (a recurrent layer's projection inputs: TimeStepRule)
            kept += c.fast.operands()
    c.a_print = list(zip(kept, [t._version for t in kept], fingerprints(kept)))
    return c


class CompiledStep:
    """The compiled path's part in one engine call (:mod:`dpclip.engine.compiled`): ``pending``,
    the plans whose first step this call is (its chunks run on the traced path; the engine adopts
    them once the whole step passed, with ``frozen``, the constants the first chunk read);
    ``ran``, whether a chunk ran a proved graph; ``traced``, whether one ran traced; ``prefer``: a
    graph that cannot be proved or run leaves the chunk to the traced path (``auto``) instead of
    refusing the model (``compiled``)."""

    __slots__ = ("pending", "ran", "traced", "prefer", "frozen", "_gc", "take", "state", "only")

    def __init__(self, prefer: bool, take: Any = None, only: Any = None) -> None:
        #: the graph pass of a graph's first step: the plans its traced pass adopted, the only
        #: programs it may run (anything else, a traced chunk included, refuses the step)
        self.only = only
        #: what takes a copy of the step's state (the model's parameters and buffers, the
        #: batch) when a graph's first step begins, before any of its user code runs; the graph
        #: pass that follows must find that state (GhostEngine._guarded)
        self.take = take
        self.state: Any = None
        #: whether Python's cyclic collector was on when the first graph chunk paused it
        self._gc: bool | None = None
        self.pending: list[Any] = []
        #: per pending plan (by position): its constants as the step's first chunk read them
        self.frozen: list[dict] = []
        self.ran = False
        #: whether a chunk of this step ran on the traced path (the later ones then do too)
        self.traced = False
        self.prefer = prefer

    def pause_gc(self) -> None:
        """Pause Python's cyclic collector for a graph chunk, from its graph to the end of its
        reduction (:meth:`resume_gc`, inside the chunk's isolation): a graph chunk runs no user
        code and has no watch, and a finalizer of an object an earlier traced step left in a
        reference cycle would otherwise run at whatever allocation the collector picks, between
        the graph and its backward (a weight written through ``.data`` there reaches the sum). Traced chunks keep the collector, so
        that the cycles their user code leaves are finalized inside their checks where it runs
        (seventy-fourth hostile review: paused for the whole call, such a finalizer ran after
        them, 4.76 C)."""
        if self._gc is None:
            self._gc = gc.isenabled()
            gc.disable()

    def resume_gc(self) -> None:
        if self._gc:
            gc.enable()
        self._gc = None


def _forward(model: nn.Module, scan: _Scan, loss_fn: LossFn, xs: Any,
             ys: Any, batch: int, chain: list[nn.Module] | None = None,
             gens: OwnGenerators | None = None,
             carry: list | None = None,
             compiled: CompiledStep | None = None) -> tuple[list[_Call], Tensor, bool]:
    """The hooked forward pass: ``(calls, the per-example losses (B,), user_code)``; hooks
    removed after. ``xs``/``ys``: tensors, or tuples/dicts of tensors (:mod:`dpclip.engine.batch`).
    ``user_code`` is False only for a program of known modules and a known loss
    (:func:`_run_known_program`): no user code ran between the creation of its autograd nodes and
    the engine's backward, so none could attach a hook to them (the backward may then run on
    autograd's own engine; :mod:`dpclip.engine.hook_free`). ``chain``: the step's closed
    program (:func:`_closed_chain`), checked once for all its chunks. ``gens``: the chunk's own
    generators (:mod:`dpclip.engine.generators`), which adopt the explicit generators that the
    proved program draws from."""
    # every operation is traced, and the batch size, private, must be used only as the leading
    # dimension (proved once per signature with a symbolic batch size; the real forward then
    # takes the same data-independent paths). The engine runs every chunk on a multiple of 32
    # rows (GhostEngine._chunk), so that a chunk of one is proved and matched as a batch is
    if batch < 2:  # (internal)
        raise AssertionError("ghost_forward._forward: a chunk of one reaches the forward (the "
                             "engine runs every chunk on a multiple of 32 rows)")
    ambient = ambient_user_code()
    if ambient is not None:  # user code on every operation, the trace's and the backward's
        # (not a vmap fallback: vmap would run under the same user code, which sees the whole
        # batch there; and it may have been entered by an earlier step's loss)
        raise _NotTheProvedProgram(
            f"{ambient} when the step starts: user code would run on the forward's or the "
            "backward's operations (or rewrite the tensors the backward reads), which the "
            "separability proof cannot see. Leave the context before the step "
            "(torch.device(...) is allowed); every engine refuses it")
    known = _run_known_program(model, scan, loss_fn, xs, ys, batch, chain)
    if known is not None:  # proved by the modules' and the loss's semantics: no trace
        if carry:  # (no user code ran: nothing of it to release)
            carry.clear()
        return (*known, False)
    # the ruled layers' batch-less calls are expanded to the batch (dpclip.engine.batchless):
    # the proof traces the program the engine runs
    why, program = proof_of(model, loss_fn, xs, ys, tuple(
        (o.module, o.rule is _MODULE) for o in scan.owners))
    if compiled is not None:  # the proof's graph, proved once, runs instead of the user's code
        got = _compiled_forward(model, scan, xs, ys, batch, why, program, carry, compiled)
        if got is not None:
            return got
        if compiled.only is not None:
            # (the graph pass of a graph's first step: never a traced chunk, whose sum would be
            # released; hundred-and-sixty-eighth hostile review: a collector finalizer between
            # the passes changed a plain attribute, the proof's key, and the second pass proved,
            # traced and released another program, 6.97 C under auto and compiled)
            raise _RuntimeUnsupported(
                "the graph pass of a graph's first step could not run the graph its traced pass "
                "adopted (the model's Python state, the proof's key, changed between the passes, "
                "or the graph was refused): keep the model's attributes unchanged in the step")
        compiled.traced = True
        # (the graph's first step: traced below, as on the ghost engine)
    if gens is not None and program is not None:
        gens.adopt(program.generators())
    with data_independent_paths():  # first: an error of the user's own code surfaces as is
        try:
            got = _forward_traced(model, scan, loss_fn, xs, ys, batch,
                                  program if why is None else None, carry)
        except RuntimeError as exc:  # the step's saved-tensor watch holds autograd's hook slot
            if "register_hooks on a saved tensor" not in str(exc):
                raise
            # (not a vmap fallback: vmap would run the hook, which may hand the backward another
            # call's tensor: LOO 2.26 C at max_physical_batch=1)
            raise _NotTheProvedProgram(
                "a saved-tensor hook was registered in the call (grad_fn._raw_saved_*."
                "register_hooks): its unpack hook would hand the backward a tensor the "
                "separability proof cannot see (another call's, another example's)") from None
    if why is not None:
        raise _RuntimeUnsupported(
            f"the forward pass and loss are not proved per-example separable: {why}. The "
            "realised batch size is private: normalise by a public constant (the expected "
            "batch size) outside loss_fn, or use engine 'vmap'")
    return (*got, True)


def _compiled_forward(model: nn.Module, scan: _Scan, xs: Any, ys: Any, batch: int,
                      why: str | None, program: ProvedProgram | None,
                      carry: list | None, compiled: CompiledStep
                      ) -> tuple[list[_Call], Tensor, bool] | None:
    """:func:`_forward` on the compiled engine (:mod:`dpclip.engine.compiled`): no user code runs,
    so nothing of the last chunk is left to release and the backward runs on autograd's own
    engine (``user_code`` False). None on the graph's first step, which runs on the traced path
    (the plan is appended to ``pending``; the caller confirms it once the step succeeded, drops
    that pass's sum and runs the step again on the graph: ``GhostEngine._guarded``): what
    the graph does not show (a tensor or module backward hook, a custom autograd Function's
    backward, a value of the batch read through an escape the export took as a constant) is
    refused there, as on the ghost engine, and the program that step ran is the graph's (the
    proved-program match).

    ``compiled.prefer`` (``auto``): a graph that is not proved, or a step whose checks refuse to
    run it (:meth:`compiled.Plan.run` checks before it runs anything), returns None too: the
    chunk runs on the traced path, every check of the ghost engine included."""
    if why is not None:
        if compiled.prefer:  # (the traced path refuses it with the same reason)
            return None
        raise _RuntimeUnsupported(
            f"the forward pass and loss are not proved per-example separable: {why}. The "
            "realised batch size is private: normalise by a public constant (the expected "
            "batch size) outside loss_fn, or use engine 'vmap'")
    try:
        if autocast_on():  # (refused by every graph step; not analysed under it either: the
            # analysis runs the graph's operations, which autocast would rewrite)
            raise CompiledUnsupported("autocast is on: the graph's operations would be rewritten")
        plan = plan_of(program, model, scan, xs, ys)
        if compiled.only is not None and not any(plan is p for p in compiled.only):
            raise CompiledUnsupported("not the graph the traced pass adopted")
        if not plan.confirmed:
            if plan not in compiled.pending:
                if compiled.state is None and compiled.take is not None:
                    compiled.state = compiled.take()  # (before this chunk's user code runs)
                compiled.pending.append(plan)
            return None
        if carry and compiled.traced:
            # an earlier chunk of this step ran traced: its tensors, released only once the next
            # traced chunk's watch is armed (ghost._chunk), would run their finalizers (user code)
            # in this chunk with no watch (seventy-second hostile review: chunk 1's finalizer
            # wrote a weight between chunk 2's graph and its backward, 3.10 C): traced as well
            raise CompiledUnsupported("an earlier chunk of this step ran on the traced path")
        if plan.failed is not None:
            raise CompiledUnsupported(plan.failed)
        compiled.pause_gc()
        if carry:  # (an earlier graph chunk's tensors: the engine's own, no user code made them)
            carry.clear()
        try:
            calls, losses = plan.run(model, scan, xs, ys, batch)
        except RuntimeError as exc:
            if not compiled.prefer:
                raise
            # auto: a graph that fails where the model's own code runs (a kernel of this device
            # the analysis never ran) is not run again; the step runs traced. The graph is
            # out-of-place and runs no user code: nothing of this attempt is left anywhere
            plan.failed = f"the graph failed when it ran: {quote_error(exc)}"
            compiled.resume_gc()  # (the chunk runs traced: the collector as on a traced chunk)
            return None
    except CompiledUnsupported as exc:
        if compiled.prefer:
            return None
        raise _RuntimeUnsupported(f"the compiled engine cannot run this model: {exc}") from None
    compiled.ran = True
    return calls, _check_losses(losses, batch), False


def _proof_free(tracer: SeparabilityTracer, t: Any) -> bool:
    """Whether the step's proved program shows ``t`` (an operation's output) with a shape free of
    the batch size (engine code: the tracer's checks pause)."""
    match = tracer.match
    if match is None or not isinstance(t, Tensor):
        return False
    quiet, tracer.quiet = tracer.quiet, True
    try:
        name = match.names.get(t)
    finally:
        tracer.quiet = quiet
    if name is not None and name[0] == "detached":
        name = name[1]
    return name is not None and name[0] == "op" and name[1] in match.program.shapes and \
        not match.program.symbolic(name)


def _examples_in_dim1(lay: Any) -> bool:
    return isinstance(lay, tuple) and lay[0] == 1


def _forward_traced(model: nn.Module, scan: _Scan, loss_fn: LossFn, xs: Any,
                    ys: Any, batch: int, program: ProvedProgram | None = None,
                    carry: list | None = None) -> tuple[list[_Call], Tensor]:
    """The traced forward; ``program``: what the batch-size proof ran, matched op by op against
    this run (:mod:`dpclip.engine.proved_program`: the step must be the program that was proved)."""
    tracer = SeparabilityTracer(batch)
    saved: Any = _cm.nullcontext()
    if program is not None:
        tracer.match = ProgramMatch(program, batch, model, xs, ys)
        saved = tracer.match.watching()  # what the backward reads and runs is watched too
        if carry:
            # the previous chunk's tensors, held until its rules had read them, are released
            # once this chunk's watch has its copies: a finalizer they run (user code, e.g. one
            # writing a buffer from that chunk's data) is then a write the watch compares
            # (twenty-fourth hostile review: released between chunks, LOO 2.17 C)
            tracer.match.armed = carry.clear
    try:
        with saved:
            return _traced_call(tracer, model, scan, loss_fn, xs, ys, batch)
    except BaseException:
        # a call refused or failed half-way: the batch data it already carried out of the call
        # (a closure, a global) is a past batch's data in every later trace, as after a
        # finished call (_check_separable retires the tracer there)
        tracer.retire()
        raise


def _traced_call(tracer: SeparabilityTracer, model: nn.Module, scan: _Scan,
                 loss_fn: LossFn, xs: Any, ys: Any, batch: int) -> tuple[list[_Call], Tensor]:
    calls: list[_Call] = []
    by_module = scan.by_module
    chain = _plain_chain(model, by_module) if isinstance(xs, Tensor) else None
    for t in batch_leaves(xs, "inputs") + batch_leaves(ys, "targets"):
        tracer.mark(t, (0, 1))  # every leaf of the inputs and targets: example data, batch first
    if chain is not None:  # the same calls as the hooks would see, without hooks
        return _chain_call(tracer, chain, by_module, loss_fn, xs, ys, batch)
    _arm(tracer)  # user code runs from here on

    expanded: list[str] = []  # layers whose batch-less calls were expanded
    # uses of expanded outputs that had no leading 1
    guard = BroadcastGuard(batch, lambda: _engine_code(tracer),
                           lambda new, old: _alias(tracer, new, old))

    def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        a = args[0] if args else next(iter(kwargs.values()), None)
        owner = by_module[ident(mod)]
        _refuse_user_forward_hooks(owner.name, mod, hook)
        _refuse_proof_leftovers(owner.name, args, kwargs)
        per_layer = owner.rule is _MODULE
        if is_batchless(a, out, per_layer) and not (
                per_layer and _examples_in_dim1(tracer.layout(out))):
            # (a per-layer call returning (1, B, ...) example data, a pooling over time of a
            # sequence-first input: the examples are in dimension 1, not batch-less; the proof
            # decides the same from its symbolic shape, batchless.expanding_hooks; fifty-sixth
            # hostile review)
            # a call without the batch (a (1, T) position index, a (1, T, d) table): its output
            # (and a ruled layer's input) as batched views, the output returned in place of the
            # original (dpclip.engine.batchless); the trace sees the expansion, the call reads the
            # view's layout, then marks it (0, 1)
            with _engine_code(tracer):  # (grad_fn: the engine's read)
                if not per_layer:
                    a = expand_rows(a, batch)
                got = expand_rows(out, batch)
                source = out.grad_fn
            _alias(tracer, got, out)
            out = got
            expanded.append(owner.name)
            calls.append(_engine_call(owner, a, out, tracer))
            calls[-1].source = source
            return out
        if not per_layer and is_unbatched(a, out, batch, lambda: _constant(tracer, a),
                                          _proof_free(tracer, out)):
            # no batch dimension and no leading 1 (an Embedding on a 1-D arange(T)): expanded
            # with an extra leading B, every later use guarded (dpclip.engine.batchless)
            user, original = tuple(out.shape), out
            with _engine_code(tracer):  # (grad_fn: the engine's read)
                a = a.unsqueeze(0).expand(batch, *a.shape)
                got = out.unsqueeze(0).expand(batch, *out.shape)
                source = out.grad_fn
            _alias(tracer, got, out)
            out = got
            expanded.append(owner.name)
            calls.append(_engine_call(owner, a, out, tracer))
            calls[-1].source = source
            guard.start()
            guard.guard(out, owner.name, user, original)
            return out
        calls.append(_engine_call(owner, a, out, tracer))
        return None

    def enter(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        # the engine's own code (it reads the autograd sequence number), not user code: the
        # tracer's Python checks pause, as in _engine_call
        if by_module[ident(mod)].rule is not _MODULE:
            # a ruled layer: Module.__call__ has just looked its forward up (this pre-hook runs
            # first, global pre-hooks are refused), so an instance forward or a class installed
            # for this call is still there
            _refuse_instance_code(by_module[ident(mod)].name, mod, classes[ident(mod)])
            return None
        quiet, tracer.quiet = tracer.quiet, True
        try:
            by_module[ident(mod)].enter(mod, args, kwargs, tracer.match)
        finally:
            tracer.quiet = quiet

    classes = {ident(o.module): type(o.module) for o in scan.owners}  # before any user code
    handles = []
    try:
        for o in scan.owners:
            handles.append(o.module.register_forward_hook(hook, with_kwargs=True))
            # the per-layer path needs the call's autograd window; a ruled layer's call must run
            # its class's code (checked at the call: third hostile review)
            handles.append(o.module.register_forward_pre_hook(enter, with_kwargs=True,
                                                              prepend=True))
        try:
            with torch.enable_grad(), tracer:
                try:
                    losses = _user_loss(tracer, loss_fn, call_model(model, xs), ys, batch)
                finally:
                    guard.stop()  # (pushed by the hook at the first guarded output, if any)
        except NotBroadcast as exc:
            raise _RuntimeUnsupported(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - only where the engine changed the program
            # the engine's own refusals pass as they are: a proof leftover read by a layer
            # (_NotTheProvedProgram) is never a vmap fallback, also after an expansion (taken for
            # a failure of the expanded output, it became one under auto: the forward's state
            # outside its modules then read by vmap from one call to the next)
            if not expanded or isinstance(exc, (_RuntimeUnsupported, UnsupportedModelError)):
                raise
            raise _RuntimeUnsupported(  # (the library's numbers masked: a size may be the batch's)
                f"layer {expanded[0]!r} was called without the batch dimension (leading "
                "dimension 1) and the forward pass failed on its output expanded to the batch "
                f"({quote_error(exc)}); the ghost engine reads per-example gradients "
                "of such a call from the expanded output: let the code after the layer "
                "broadcast it (e.g. x + pos), or use engine 'vmap'") from exc
    finally:
        for h in handles:
            h.remove()
    _check_separable(tracer, calls, losses)
    return calls, losses


def _chain_call(tracer: SeparabilityTracer, chain: list[nn.Module],
                by_module: dict[int, "_Owner"], loss_fn: LossFn, xs: Tensor, ys: Any,
                batch: int) -> tuple[list[_Call], Tensor]:
    """:func:`_traced_call` for a plain chain (:func:`_plain_chain`): run by the engine without
    hooks; a chain of known modules is proved by their semantics, another one traced (its layouts
    cached per :func:`_chain_key`); the loss, user code, is traced (and matched against the proof)
    on every call."""
    calls: list[_Call] = []
    if type(xs) is Tensor and _known_chain(chain):
        # (a subclass input runs __torch_function__ in every layer: third hostile review)
        got = _run_known_chain(chain, by_module, xs, batch)
        if got is not None:  # proved per-example separable by the modules' semantics
            calls, h = got
            for c in calls:  # the loss is user code: it runs after the calls
                _printed(c)
            tracer.mark(h, (0, 1))
            if tracer.match is not None:  # the chain is library code: the loss is matched
                tracer.match.start_at_loss(h)
            with torch.enable_grad(), tracer:  # the loss is user code: traced every call
                losses = _user_loss(tracer, loss_fn, h, ys, batch)
            _check_separable(tracer, calls, losses)
            return calls, losses
    _arm(tracer)  # the chain's modules may be user code
    classes = {ident(m): type(m) for m in chain}  # before any user code
    # (no cache under interpreter callbacks: user code then runs inside the modules' forwards)
    key = _chain_key(chain, xs, by_module) if python_callbacks() is None else None
    cached = _CHAIN_LAYOUTS.get(key) if key is not None else None
    chain_tracer = tracer if cached is None else None
    with torch.enable_grad():
        with chain_tracer or _cm.nullcontext():
            h = xs
            for mod in chain:
                owner = by_module.get(ident(mod))
                if owner is None:
                    h = mod(h)
                else:
                    # (installed by an earlier module of the chain)
                    _refuse_instance_code(owner.name, mod, classes[ident(mod)])
                    out = mod(h)
                    c = _engine_call(owner, h, out, chain_tracer)  # (printed when traced)
                    calls.append(c if chain_tracer is not None else _printed(c))
                    h = out
        if cached is not None:
            for c, lay in zip(calls, cached[0]):
                c.layouts = lay
            tracer.mark(h, cached[1])
        elif key is not None and tracer.violation is None \
                and all(c.layouts[1] != REWRITTEN for c in calls):
            if len(_CHAIN_LAYOUTS) >= 256:
                _CHAIN_LAYOUTS.clear()
            _CHAIN_LAYOUTS[key] = (tuple(c.layouts for c in calls), tracer.layout(h))
        if chain_tracer is None and tracer.match is not None:
            tracer.match.start_at_loss(h)  # the chain ran untraced (library code, cached)
        with tracer:  # the loss is user code: traced every call
            losses = _user_loss(tracer, loss_fn, h, ys, batch)
    _check_separable(tracer, calls, losses)
    return calls, losses


def _arm(tracer: SeparabilityTracer) -> None:
    """Start the match's memory watch (dpclip.engine.memory_watch) before user code runs."""
    if tracer.match is not None:
        tracer.match.arm()


def _user_loss(tracer: SeparabilityTracer, loss_fn: LossFn, out: Any, ys: Any,
               batch: int) -> Tensor:
    """``loss_fn(out, ys)`` (user code, traced and matched against the proof), then the engine's
    shape check (not user code: after the match has ended)."""
    raw = loss_fn(out, ys)
    if tracer.match is not None:
        tracer.match.finish(raw)
    return _check_losses(raw, batch)


@_cm.contextmanager
def _engine_code(tracer: SeparabilityTracer) -> Any:
    """The engine's own operations inside the traced forward: the tracer's Python checks and the
    proved-program match pause (layouts are still tracked)."""
    quiet, tracer.quiet = tracer.quiet, True
    try:
        yield
    finally:
        tracer.quiet = quiet


def _alias(tracer: SeparabilityTracer, new: Tensor, old: Tensor) -> None:
    """The engine's expansion ``new`` stands, in the user's program, for the layer output ``old``
    (the proof's recorder aliases its own expansion the same way)."""
    if tracer.match is not None:
        tracer.match.alias(new, old)


def _constant(tracer: SeparabilityTracer, a: Tensor) -> bool:
    """Whether ``a`` is constant for the trace; the engine's own read, with the tracer's Python
    checks paused (it reads the storage)."""
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

_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep


def _torch_own(f: Any) -> bool:
    code = getattr(f, "__code__", None)
    return code is not None and os.path.realpath(code.co_filename).startswith(_TORCH_DIR)


#: each known class's ``forward`` and ``Module.__call__`` as torch's own files define them (taken at
#: import): a class-level patch (``nn.Tanh.forward = ...``) made the known chain run user code
#: untraced (second hostile review: a patched Tanh centring over the batch, LOO 3.14 C)
_KNOWN_FORWARD = {cls: cls.forward for cls in _KNOWN_MODULES if _torch_own(cls.forward)}
_MODULE_CALL = (nn.Module.__call__, nn.Module._call_impl) \
    if _torch_own(nn.Module._call_impl) else None


def _batched_rank(mod: nn.Module, a: Tensor) -> bool:
    """Whether a supported layer (or a subclass keeping its forward) receives its BATCHED rank,
    the rank at which its documented batch dimension is dimension 0."""
    for cls in type(mod).__mro__:
        pred = _KNOWN_MODULES.get(cls)
        if pred is not None:
            return pred(mod, a) or isinstance(mod, _BatchNorm)  # BatchNorm checks its own rank
    return True


def _known_chain(chain: list[nn.Module]) -> bool:
    """Whether every module of the chain is of a known exact class with torch's own forward, a
    plain instance (:func:`dpclip.engine.plain_module.plain_instance`: no hooks, no instance code,
    configuration of exact built-in types, exact parameters and buffers; third hostile review),
    no global hooks and no user code active around the call (modes, saved-tensor hooks, trace
    and profile functions, ``sys.monitoring`` tools: :func:`python_callbacks`)."""
    if _MODULE_CALL is None or (nn.Module.__call__, nn.Module._call_impl) != _MODULE_CALL:
        return False
    if not global_hooks_clear() or ambient_user_code() is not None \
            or python_callbacks() is not None:
        return False
    for mod in chain:
        if type(mod) not in _KNOWN_MODULES or not plain_instance(mod) \
                or _KNOWN_FORWARD.get(type(mod)) is not type(mod).forward:
            return False
    # what their forwards look up by name (F.linear, torch.tanh) is torch's own too
    return library_changed({type(mod) for mod in chain}) is None


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
            owner = by_module.get(ident(mod))
            if owner is not None:
                c = _Call(owner, h, out)
                c.layouts = ((0, 1), (0, 1))
                calls.append(c)
            h = out
    return calls, h


def _tree_spec(cls: type) -> dict | None:
    """The ``KNOWN_PROGRAM`` declaration of one of dpclip's own model classes
    (:data:`dpclip.registry.KNOWN_PROGRAMS`, by identity) whose ``forward`` is still the function
    it was registered with: ``{"children": {name: exact class}, "config": {name: exact type}}``;
    None for any other class."""
    fwd = KNOWN_PROGRAMS.get(cls)
    d = cls.__dict__
    spec = d.get("KNOWN_PROGRAM")
    if fwd is None or d.get("forward") is not fwd or type(spec) is not dict:
        return None
    return spec


def _known_tree(model: nn.Module) -> list[nn.Module] | None:
    """Every module of ``model`` when it is a known tree: a dpclip model class that declares its
    program (:func:`_tree_spec`: ``TextTransformer`` and its blocks), every child of the exact class
    its declaration names, down to known ``torch.nn`` leaves (:data:`_KNOWN_MODULES`, torch's own
    forward) and ``nn.ModuleList`` containers; plain instances without hooks, no parameters or
    buffers of their own on the composite classes, their configuration of the declared exact types;
    no global hooks, no user code around the call, and every name the forwards look up still
    torch's own (:func:`library_changed`). Such a forward is code dpclip wrote, reading no batch
    size as a value and mixing no examples (docs/engines.md, "Known programs"); with a known loss
    no user code runs in the step. None: not a known tree (the engine traces it)."""
    if _MODULE_CALL is None or (nn.Module.__call__, nn.Module._call_impl) != _MODULE_CALL:
        return None
    if _tree_spec(type(model)) is None or not global_hooks_clear() \
            or ambient_user_code() is not None or python_callbacks() is not None:
        return None
    out: list[nn.Module] = []
    stack: list[tuple[nn.Module, type]] = [(model, type(model))]
    while stack:
        mod, want = stack.pop()
        cls = type(mod)
        if cls is not want or not _no_hooks(mod) or not plain_instance(mod) \
                or type(mod.__dict__.get("training")) is not bool:
            return None
        out.append(mod)
        kids = mod._modules
        if type(kids) is not dict and type(kids) is not collections.OrderedDict:
            return None
        if cls is nn.ModuleList:
            for k in kids.values():
                if k is None:
                    return None
                stack.append((k, type(k)))
            continue
        if cls in _KNOWN_MODULES:
            if kids or _KNOWN_FORWARD.get(cls) is not cls.forward:
                return None
            continue
        spec = _tree_spec(cls)
        if spec is None or mod._parameters or mod._buffers:
            return None
        children, config = spec.get("children", {}), spec.get("config", {})
        if list(kids) != list(children):
            return None
        for name, kid in kids.items():
            want_kid = children[name]
            if kid is None or (want_kid is not nn.ModuleList and _tree_spec(want_kid) is None
                               and want_kid not in _KNOWN_MODULES):
                return None
            stack.append((kid, want_kid))
        d = mod.__dict__
        if any(type(d.get(name)) is not typ for name, typ in config.items()):
            return None
    if library_changed({type(m) for m in out}) is not None:
        return None
    return out


class _Tree(list):
    """The modules of a closed program's known tree (:func:`_known_tree`), as ``_closed_chain``
    returns them for the step (a list: a chain's modules, or these)."""


def _run_known_tree(model: nn.Module, modules: list[nn.Module],
                    by_module: dict[int, "_Owner"], xs: Tensor,
                    batch: int) -> tuple[list[_Call], Tensor] | None:
    """Run a known tree (:func:`_known_tree`) with forward hooks that record each ruled layer's
    call (layouts ``(0, 1)``: its input and output hold example i in row i, proved by the tree's
    code) and pre-hooks that check each known module's predicate on the input it receives, as a
    chain's run does. ``None`` when a check fails (the caller then traces)."""
    calls: list[_Call] = []
    bad: list[bool] = []
    handles = []

    def pre(mod: nn.Module, args: tuple) -> None:
        pred = _KNOWN_MODULES.get(type(mod))
        if pred is not None and (len(args) != 1 or type(args[0]) is not Tensor
                                 or not pred(mod, args[0])):
            bad.append(True)

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        owner = by_module.get(ident(mod))
        if owner is None:
            return
        if type(out) is not Tensor or out.ndim == 0 or out.shape[0] != batch or not args \
                or type(args[0]) is not Tensor or args[0].shape[0] != batch:
            bad.append(True)
            return
        c = _Call(owner, args[0], out)
        c.layouts = ((0, 1), (0, 1))
        calls.append(c)

    try:
        for mod in {ident(m): m for m in modules}.values():  # (a layer used twice: hooked once)
            if type(mod) in _KNOWN_MODULES:
                handles.append(mod.register_forward_pre_hook(pre))
                if ident(mod) in by_module:
                    handles.append(mod.register_forward_hook(post))
        with torch.enable_grad():
            h = model(xs)
    finally:
        for hd in handles:
            hd.remove()
    if bad or type(h) is not Tensor or h.ndim == 0 or h.shape[0] != batch:
        return None
    return calls, h


def _run_known_program(model: nn.Module, scan: _Scan, loss_fn: LossFn, xs: Any, ys: Any,
                       batch: int, chain: list[nn.Module] | None = None
                       ) -> tuple[list[_Call], Tensor] | None:
    """``(calls, the per-example losses (B,))`` of a program proved per-example separable by
    semantics alone, without a trace and without the batch-size proof: a plain chain of known
    modules (:func:`_run_known_chain`, its run-time checks included) or a known tree of dpclip's
    own model classes (:func:`_known_tree`, :func:`_run_known_tree`) on a plain tensor, then a
    known loss (:mod:`dpclip.engine.known_losses`: e.g. dpclip's ``cross_entropy_per_example`` or
    an exact ``nn.CrossEntropyLoss(reduction='none')`` on ``(B, C)`` logits). No user code runs in
    it, and no part of it reads the batch size as a value. ``None``: not such a program (the
    caller traces it as before; the chain may then run a second time)."""
    if chain is None:  # (given: the step's closed program, checked by _closed_chain)
        if type(xs) is not Tensor or not known_loss_fn(loss_fn):
            return None
        chain = _plain_chain(model, scan.by_module)
        if chain is None or not _known_chain(chain):
            tree = _known_tree(model)
            if tree is None:
                return None
            chain = _Tree(tree)
    got = _run_known_tree(model, chain, scan.by_module, xs, batch) \
        if isinstance(chain, _Tree) else _run_known_chain(chain, scan.by_module, xs, batch)
    if got is None or not known_loss(loss_fn, got[1], ys, batch):
        return None
    calls, h = got
    with torch.enable_grad():
        losses = _check_losses(loss_fn(h, ys), batch)
    # as after a traced call: this batch's tensors are a past batch's data in every later trace
    tracer = SeparabilityTracer(batch)
    for t in (xs, ys, h, losses):
        tracer.mark(t, (0, 1))
    tracer.retire()
    return calls, losses


def _closed_chain(model: nn.Module, scan: _Scan, loss_fn: LossFn, xs: Any,
                  ys: Any) -> list[nn.Module] | None:
    """The chain of a closed program, or None: plain tensors in, a known loss, and a plain
    chain of known modules or a known tree (a :class:`_Tree`) of dpclip's own model classes
    (:func:`_run_known_program`'s conditions, :func:`_known_chain`'s / :func:`_known_tree`'s
    included: no global hooks, modes, saved-tensor hooks or interpreter callbacks, and what the
    modules' forwards look up is torch's own). With a strategy of dpclip's own (the caller's
    ``StepWeights.closed``) no user code runs anywhere in the step: the engine then skips the
    state guard (nothing but torch's modules and dpclip's code could write the model's state,
    and none of them does) and checks the chain once for all chunks."""
    if type(xs) is not Tensor or type(ys) is not Tensor or not known_loss_fn(loss_fn):
        return None
    chain = _plain_chain(model, scan.by_module)
    if chain is None or not _known_chain(chain):
        tree = _known_tree(model)
        return _Tree(tree) if tree is not None else None
    return chain


#: separability layouts of plain chains of built-in modules, by :func:`_chain_key`: ``(layouts of
#: the hooked calls, layout of the chain's output)``. Sound to reuse: a built-in ``torch.nn`` module's
#: operations depend only on its class, its public configuration (all part of the key), its
#: parameters' and buffers' shapes (fixed by that configuration) and the input's shape and dtype
#: (part of the key), never on the data; the loss function, user code, is traced on every call
_CHAIN_LAYOUTS: dict[tuple, tuple] = {}
#: every ``torch.nn`` module class torch defines, with its forward, taken at import
_TORCH_FORWARD = {c: c.forward for c in vars(nn).values()
                  if isinstance(c, type) and issubclass(c, nn.Module) and c is not nn.Module
                  and _torch_own(c.forward)}
_SIMPLE = (int, float, bool, str, type(None))


def _chain_key(chain: list[nn.Module], xs: Tensor, by_module: dict[int, Any]) -> tuple | None:
    """The cache key of a plain chain's separability trace, or None (not cacheable: a module that
    is not a built-in ``torch.nn`` class, or public configuration that is not plain data). The key
    says which modules are layers of the call (``by_module``: those with trainable parameters): the
    cached layouts are handed to the calls in order, so a layer frozen when they were cached and
    trainable now got another layer's layouts, or none (forty-eighth hostile review: a crash)."""
    if type(xs) is not Tensor or not global_hooks_clear() or ambient_user_code() is not None:
        return None
    parts: list[Any] = [tuple(xs.shape), xs.dtype, xs.device.type]
    for mod in chain:
        cls = type(mod)
        # torch's own class with torch's own forward (a user class can name its __module__
        # "torch.nn.modules..."), a plain instance (no hooks on a layer that owns no parameters,
        # no instance _conv_forward, ...: third hostile review, LOO 2.46-3.61 C before)
        if _TORCH_FORWARD.get(cls) is not cls.forward or not plain_instance(mod):
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
        parts.append((cls, tuple(conf), ident(mod) in by_module))
    if library_changed({type(mod) for mod in chain}) is not None:  # (a replaced F.linear, ...)
        return None
    return tuple(parts)


def _refuse_proof_leftovers(name: str, args: tuple, kwargs: dict) -> None:
    """Raise :class:`_NotTheProvedProgram` if a layer of the real run is called on a fake tensor
    of the batch-size proof: the forward kept a tensor of the proof's trace in state outside its
    modules (a global, a closure; written during the proof, read now), so the run is not the
    program that was proved (hostile review, issue 31: it crashed the step before). Never a vmap
    fallback: vmap would read what the forward keeps there from one call to the next, which no
    check sees (the state guard covers the model's own state; a chunk of one reading the previous
    chunk's input from a global: 2.70 C under ``auto`` when this was a fallback reason)."""
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, Tensor) and is_fake(t):
            raise _NotTheProvedProgram(
                f"layer {name!r} was called on a tensor left over from the separability proof "
                "(the forward keeps tensors in state outside its modules: a global, a closure, a "
                "default argument, which vmap would read from one call to the next too), so the "
                "step is not the program that was proved. Keep such state in registered buffers "
                "(they are guarded) or compute it in the call")


def _refuse_instance_code(name: str, mod: nn.Module, cls: type | None = None) -> None:
    """Raise :class:`_NotTheProvedProgram` if a ruled layer's call would run code that is not its
    class's (an instance ``forward`` or ``_conv_forward``, a parameter of a tensor subclass,
    :func:`dpclip.engine.plain_module.instance_code`): the engine reads the layer's per-example
    gradient from its input and output as the class's forward relates them, while an instance
    ``forward`` may mix its output over the batch (third hostile review: installed during the
    call and deleted by itself, accepted with LOO 2.00 C; so was a class swapped for the call,
    ``cls``: the class when the step started). Not a vmap fallback: whether the code is installed
    can depend on the batch size."""
    if cls is not None and type(mod) is not cls:
        raise _NotTheProvedProgram(
            f"layer {name!r} was called as an instance of {type(mod).__name__}, not of its class "
            f"{cls.__name__} (its __class__ was replaced for the call), so its per-example "
            "gradient is not the one its rule reads; do not replace a layer's class during the "
            "forward")
    pre = _module_mod._global_forward_pre_hooks
    if type(pre) not in (dict, collections.OrderedDict) or len(pre):
        raise _NotTheProvedProgram(
            f"a global forward pre-hook runs before layer {name!r} (after Module.__call__ looked "
            "its forward up): it could change the code that call runs. Remove it "
            "(torch.nn.modules.module.register_module_forward_pre_hook), or use engine 'vmap'")
    what = instance_code(mod)
    if what is not None:
        raise _NotTheProvedProgram(
            f"layer {name!r} ({type(mod).__name__}) runs code its class does not define (its "
            f"instance attribute {what!r} replaces the class's), so its per-example gradient is "
            "not the one its rule reads; do not replace a layer's forward or parameters on the "
            "instance (subclass it, or wrap it in a module of your own)")


def _refuse_user_forward_hooks(name: str, mod: nn.Module, ours: Any) -> None:
    """Raise :class:`_RuntimeUnsupported` if a forward hook other than the engine's own (``ours``)
    runs on a hooked layer: a user hook registered before the engine's may replace the layer's
    output (``o + o.mean(0)``), and the gradient of the replacement would then be read as the
    layer's ``b`` while the trace marks it ``(0, 1)`` (hostile review, issue 31: accepted before;
    benchmarks/results/hostile_review_loo.md)."""
    # exact tables (a dict subclass can hide its hooks from .values() and not from
    # Module.__call__, which reads .items(): third hostile review, LOO 1.06 C)
    glob, own = _module_mod._global_forward_hooks, mod._forward_hooks
    if type(glob) not in _TABLE_TYPES or type(own) not in _TABLE_TYPES or len(glob) \
            or any(h is not ours for h in dict.values(own)):
        raise _RuntimeUnsupported(
            f"layer {name!r} ({type(mod).__name__}) has a forward hook that is not the engine's: "
            "it may replace the layer's output (e.g. mix it over the batch), so the layer's "
            "per-example gradient is not proven. Remove the hook (apply its change in the "
            "model's forward instead), or use engine 'vmap'")


def _check_separable(tracer: SeparabilityTracer, calls: list[_Call],
                     losses: Tensor) -> None:
    """Raise :class:`_RuntimeUnsupported` unless the traced forward is row separable: the
    per-example losses have layout ``(0, 1)`` and every hooked layer's input ``(0, k)`` or is
    constant (each row, or block of ``k`` rows, a function of its own example; ``c.group`` is set
    to ``k``; :mod:`dpclip.engine.separable`). A constant input with one row (or block of ``k``
    rows) per example must be the same for every example: the engine reads example i's gradient
    from row i, so rows that differ (``arange(B) % 2``) make it depend on the example's position
    (thirtieth hostile review: an Embedding on ``arange(B) % 2`` beside example data, LOO 3.13 C;
    ``frac`` of a layer on such a constant, whose value is 0 but whose gradient is not, 5.98 C)."""
    b = tracer.batch
    for c in calls:
        a = c.a if c.outs is None else None
        if isinstance(a, Tensor) and c.layouts[0] is None and a.ndim and a.shape[0] >= b \
                and a.shape[0] % b == 0 and not uniform_along(tracer, a, 0, a.shape[0] // b, b):
            raise _RuntimeUnsupported(
                f"the input of layer {c.owner.name!r} ({type(c.mod).__name__}) is a constant with "
                "one row per example whose rows differ (e.g. built from torch.arange(batch size)): "
                "each example's gradient would depend on its position in the batch; give every "
                "example the same constant (expand one row), or use engine 'vmap'")
    tracer.retire()
    match = tracer.match
    if match is not None and match.mismatch is None and not match.done:
        match.finish(losses)  # (defensive: every path finishes it after the loss function)
    if match is not None and match.mismatch is not None:
        raise _NotTheProvedProgram(describe(match.mismatch))
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
        if lay_out == REWRITTEN:
            # the engine marks a ruled layer's output (0, k) below, for what its standard forward
            # computes; the trace saw it mix the examples BETWEEN that forward and the engine's
            # record of the call (a trace or profile function at the forward's return, a hook
            # running before the engine's: a Linear output rewritten in place with its batch
            # mean, LOO 2.00 C before)
            raise _RuntimeUnsupported(
                f"the output of layer {c.owner.name!r} ({type(c.mod).__name__}) was changed "
                "after the layer computed it and before the engine recorded the call, so that "
                "it mixes the examples (a sys.settrace / sys.setprofile function, or a hook that "
                f"runs at the layer's return){fix}")
        # only the input: a supported layer runs its standard forward (``_rule_for`` refuses
        # subclasses that override it), which is per sample along dimension 0 of a batch-first
        # input; its output is then marked ``(0, 1)`` (``_Call``). A layer's input (a per-layer
        # module's outputs) may hold each example in ``k`` consecutive rows, ``(0, k)`` (K
        # augmented copies, a batch flattened with another dimension): its output is then marked
        # ``(0, k)`` and example i is read from its k rows (``ghost_rules._fold_rows``, the
        # per-layer path's ``module_grads``; ``c.group``)
        if isinstance(lay_a, tuple) and lay_a[0] == 0:
            c.group = lay_a[1]
            continue
        if getattr(c, "batch_dim", 0) == 1 and lay_a == (1, c.group):
            continue  # sequence-first, on trailing dimensions (ghost_rules._sequence_first)
        for what, lay in (("input", lay_a),):
            if lay is not None and lay != (0, 1):
                how = ("mixes the examples of the batch (it depends on several examples, e.g. "
                       "through x.mean(0), a softmax or roll over the batch dimension, or an "
                       "operation the separability check does not know)") if lay == "mixed" \
                    else (f"has the batch in dimension {lay[0]}, not 0 (a sequence-first "
                          "layout: a shape coincidence such as T == B cannot hide it)")
                raise _RuntimeUnsupported(
                    f"the {what} of layer {c.owner.name!r} ({type(c.mod).__name__}) {how}{fix}")
    lay = tracer.layout(losses)
    if lay is not None and lay != (0, 1):
        raise _RuntimeUnsupported(
            "the per-example losses are not per-example separable (layout "
            f"{lay!r}: a loss row depends on other examples, e.g. a batch-centred model or a "
            f"loss normalised over the batch){fix}")
