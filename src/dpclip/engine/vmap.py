"""The reference per-example engine: ``torch.func`` ``vmap(grad(loss of one example))``.

Works for any layer that ``torch.func`` can transform (no hooks, no per-layer rules), which makes it
the reference and the oracle that faster engines (ghost) are compared against. It materializes the
per-example gradients of one physical chunk (``max_physical_batch`` examples, ``chunk * d`` floats),
reduces them at once to norms and the weighted sum, and moves to the next chunk.
"""

from __future__ import annotations

from dpclip.engine import _cm
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import Tensor, nn
from torch.func import grad, vmap
from torch.utils import _pytree as pytree

from dpclip._ident import ident
from dpclip.engine._common import (
    ChunkGrads,
    MaterializingEngine,
    UserGenerators,
    check_batch,
    check_chunk_size,
    check_per_example_model,
    trainable_params,
)
from dpclip.engine.base import LossFn
from dpclip.engine.conv_backends import (
    MOVED,
    NUMERICS_MOVED,
    THREADS_MOVED,
    conv_backends_moved,
    numerics_moved,
    threads_moved,
)
from dpclip.engine.op_entry import PY_DISPATCHER, no_compiled_autograd, python_dispatcher_on
from dpclip.engine.batch import (
    batch_leaves,
    call_model,
    map_batch,
    note_padded,
    pad_rows,
    padded_rows,
    owned_slice,
)
from dpclip.engine.errors import PrivateBufferError, UnsupportedModelError

__all__ = ["VmapEngine", "vmap_per_example_grads"]


def _kept_graph(mod: nn.Module) -> str | None:
    """The name of a tensor attribute or buffer of ``mod`` that has an autograd graph (a
    ``grad_fn``): a view or a product of a parameter kept across calls."""
    for name, v in list(vars(mod).items()) + list(mod._buffers.items()):
        t = type(v)  # (the type alone: isinstance reads a __class__ of the model's class)
        if issubclass(t, Tensor) and not issubclass(t, nn.Parameter) and \
                v.grad_fn is not None:
            return f"{'buffer' if name in mod._buffers else 'attribute'} {name!r}"
    return None


@dataclass(frozen=True)
class VmapEngine(MaterializingEngine):
    """Per-example gradients with ``torch.func.vmap(grad(...))``; returns ``sum_i w_i g_i``.

    Example ``i``'s gradient is that of ``loss_fn(model(x_i[None]), y_i[None]).sum()`` with respect to
    every trainable parameter (frozen parameters and buffers are used as they are). Norms are flat
    ``(B,)`` for one group, ``(B, G)`` per group otherwise; ``weights = weight_fn(norms)`` and group
    ``g``'s weight scales the parameters of group ``g``.

    Privacy: a non-finite per-example gradient is replaced by zeros and its norm reported as ``+inf``
    in every group (the strategy maps it to weight 0), so one poisoned example cannot corrupt the sum
    (anchors P7). Models that mix examples (BatchNorm using batch statistics) are refused with
    :class:`~dpclip.engine.errors.UnsupportedModelError` (P12). Every trainable parameter must be in
    exactly one group (``groups.validate``).

    Chunking: the batch is processed in physical chunks of at most ``max_physical_batch`` examples
    (a memory knob; results are identical up to float rounding). ``weight_fn`` is called once per
    chunk on that chunk's norms (once in all for ``B <= max_physical_batch``), so it must be row-wise
    (``w_i`` depends on ``norms_i`` only), which every DP weight function is: a weight that depended
    on other examples' norms would void the sensitivity bound. An empty batch (Poisson sampling)
    gives zero sums, empty norms and one call of ``weight_fn`` on them.

    Dropout and other randomness are drawn independently per example (``randomness="different"``).
    The model is never mutated: no ``p.grad``, no attributes, no hooks.
    """

    name: ClassVar[str] = "vmap"

    def _compute(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                 weight_fn: Any, groups: Any) -> Any:
        # the data-independent library paths (transformers reads `attention_mask.all()` into
        # Python to skip an all-ones mask, which vmap cannot run: T5 and BART called as a
        # training loop calls them failed under engine 'vmap'); the same computation per
        # example, the mask applied (auto's fallback always ran so)
        from dpclip.engine.batch_symbol import data_independent_paths

        for qualname, mod in model.named_modules():
            kept = _kept_graph(mod)
            if kept is not None:
                raise UnsupportedModelError(
                    f"vmap engine: {f'module {qualname!r}' if qualname else 'the model'} keeps {kept}, a tensor computed "
                    "from a parameter with its autograd graph (grad_fn) alive: vmap runs the "
                    "model on its own copies of the parameters, so the gradient through that "
                    "tensor would be missed (ninety-seventh review: the per-example norm 1.15x the "
                    "engine's); compute it inside forward (e.g. self.fc.bias.expand(...) there), "
                    "or detach it if it is a constant")
            if isinstance(mod, nn.RNNBase):
                # (torch.func's vmap has no batching rule for torch's fused recurrent kernel: it
                # failed with "output with shape [1, 32] doesn't match the broadcast shape
                # [32, 1, 32]" for every batch-first LSTM / GRU / RNN)
                raise UnsupportedModelError(
                    f"vmap engine: the recurrent layer {qualname!r} "
                    f"({type(mod).__name__}) cannot run under torch.func's vmap (its fused "
                    "kernel has no batching rule); use engine 'ghost' or 'auto' (their per-layer "
                    "path runs nn.LSTM / nn.GRU / nn.RNN by their time-step cells) or 'naive'")
        with data_independent_paths():
            return super()._compute(model, loss_fn, inputs, targets, weight_fn, groups)

    def _chunk_grads(self, model: nn.Module, loss_fn: LossFn,
                     params: dict[str, Tensor]) -> ChunkGrads:
        if not params:  # nothing trainable: norms are zero, only the losses are needed
            def losses_only(xs: Any, ys: Any, rows: int) -> tuple[dict[str, Tensor], Tensor]:
                with _cm.no_grad():
                    return {}, _per_example_losses(model, loss_fn, xs, ys, rows)
            return losses_only
        per_example_grads = _per_example_grad_fn(model, loss_fn)
        detached = {n: p.detach() for n, p in params.items()}

        def chunk(xs: Any, ys: Any, rows: int) -> tuple[dict[str, Tensor], Tensor]:
            padded = padded_rows(rows)
            if padded == rows:
                return per_example_grads(detached, xs, ys)
            # a chunk runs on a multiple of 32 rows, copies of its first example after it, and
            # keeps its own rows: torch picks some CPU kernels by the number of rows (a
            # convolution of one example off oneDNN, of two on it; MKL's products of few rows or
            # one column), so an example rounded unlike the same example beside more others
            # (seventy-ninth hostile review: 1.82 C on vmap at two threads; eightieth: 2.47 C)
            try:
                got, losses = per_example_grads(detached,
                                                map_batch(lambda t: pad_rows(t, padded), xs),
                                                map_batch(lambda t: pad_rows(t, padded), ys))
            except (UnsupportedModelError, PrivateBufferError):
                raise
            except (RuntimeError, ValueError, IndexError) as exc:
                note_padded(exc, "vmap")
                raise
            return {n: g[:rows] for n, g in got.items()}, losses[:rows]

        return chunk


def vmap_per_example_grads(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Any,
    targets: Any,
    *,
    max_physical_batch: int = 256,
) -> dict[str, Tensor]:
    """Materialized per-example gradients ``{name: (B, *param.shape)}`` of every trainable parameter.

    Same per-example loss as :class:`VmapEngine` and as
    :func:`~dpclip.engine.naive.naive_per_example_grads` (its oracle); raw values (NaN/Inf are not
    zeroed). For strategies of class P-GRAD (AdaClip) and for debugging; memory ``B * d``.
    Refuses models that mix examples (BatchNorm using batch statistics).
    """
    batch = check_batch(inputs, targets, "vmap")
    check_chunk_size(max_physical_batch, "vmap_per_example_grads")
    check_per_example_model(model, "vmap")
    params = {n: p.detach() for n, p in trainable_params(model).items()}
    if not batch or not params:
        return {n: p.new_zeros((batch, *p.shape)) for n, p in params.items()}
    fn = _per_example_grad_fn(model, loss_fn)

    def chunk(xs: Any, ys: Any) -> dict[str, Tensor]:
        # every chunk on a multiple of 32 rows, copies of its first example after it (the
        # engines' row block, dpclip.engine.batch.padded_rows: torch's CPU kernels pick their
        # code by the number of rows; eighty-first hostile review: AdaClip's gradients, computed
        # here, moved the others by 2.12 C where the engines' stayed at C)
        rows = batch_leaves(xs)[0].shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            xs = map_batch(lambda t: pad_rows(t, padded), xs)
            ys = map_batch(lambda t: pad_rows(t, padded), ys)
        return {n: g[:rows] for n, g in fn(params, xs, ys)[0].items()}

    chunks = [
        chunk(owned_slice(inputs, s, s + max_physical_batch),
              owned_slice(targets, s, s + max_physical_batch))
        for s in range(0, batch, max_physical_batch)
    ]
    return {n: torch.cat([c[n] for c in chunks]) for n in params}


def _check_example_loss(loss: Tensor) -> Tensor:
    if loss.ndim == 0 or loss.shape[0] != 1:
        raise ValueError(
            "loss_fn must return per-example losses with a leading batch dimension (reduction "
            f"'none'); for a batch of one example it returned shape {tuple(loss.shape)}"
        )
    return loss.sum()


_GradFn = Callable[[dict[str, Tensor], Any, Any], tuple[dict[str, Tensor], Tensor]]


def _slots(model: nn.Module) -> list[tuple[dict[str, Any], str, str]]:
    """``(module._parameters, attribute, canonical name)`` for every place a trainable parameter
    is held: each module once (a module that appears under two names is one module), each tied
    parameter under every module that holds it, named by its canonical (first) name."""
    canonical = {ident(p): n for n, p in trainable_params(model).items()}
    slots = []
    for mod in model.modules():  # each module object once
        for attr, p in mod._parameters.items():
            name = canonical.get(ident(p)) if p is not None else None
            if name is not None:
                slots.append((mod._parameters, attr, name))
    return slots


@_cm.contextmanager
def _parameters_replaced(model: nn.Module, params: dict[str, Tensor]) -> Iterator[None]:
    """Run ``model`` with its trainable parameters replaced by ``params`` (canonical names), and
    put the original parameters back afterwards, also on error.

    This is what ``torch.func.functional_call`` does, done by module object instead of by
    attribute path: ``functional_call`` (torch 2.13) leaves a module that appears under two names
    (``nn.Sequential(layer, ..., layer)``) holding the replacement tensors after the call (it swaps
    the same attribute twice and restores the wrong original), which silently turns the layer's
    parameters into plain tensors."""
    slots = _slots(model)
    saved = [(store, attr, store[attr]) for store, attr, _ in slots]
    try:
        for store, attr, name in slots:
            store[attr] = params[name]
        yield
    finally:
        for store, attr, orig in saved:
            store[attr] = orig


class _Raised(UserGenerators):
    """Around the user's forward and loss inside the batched call: the first torch function that
    raised, or drew from a generator the model holds (:class:`UserGenerators`). ``vmap`` runs the
    user's Python once for all the examples of a call, so an error that one example's values cause
    (an index out of range, ``aten._assert_async``) is raised for every example; code that catches
    it computes every example from that bit (twenty-eighth hostile review: a caught
    ``index_select`` error flipping all the logits, LOO 5.54 C under vmap and auto). A call that
    completes after an operation raised is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.raised: str | None = None
        #: a convolution ran with a backend the engine had fixed switched back on
        #: (dpclip.engine.conv_backends)
        self.conv_moved = False
        #: an operation ran at a thread count other than the one the engine fixed
        self.threads_moved = False
        #: a numerical setting (conv_backends.numerics) differed from the engine call's
        self.numerics_moved = False
        #: an operation ran with torch's Python dispatcher on (switched on by the forward)
        self.py_dispatcher = False
        #: an autograd.Function with a vmap rule of its own ran (its name)
        self.custom_vmap: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.see(func, kwargs, args)
        if "conv" in getattr(func, "__name__", "") and conv_backends_moved():
            self.conv_moved = True
        if threads_moved():
            self.threads_moved = True
        if numerics_moved():
            self.numerics_moved = True
        if python_dispatcher_on():
            self.py_dispatcher = True
        if func is _CUSTOM_FUNCTION_CALL and args and _own_vmap_rule(args[0]):
            self.custom_vmap = getattr(args[0], "__qualname__", "an autograd.Function")
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            if self.raised is None:
                name = getattr(func, "__name__", None) or str(func)
                self.raised = f"{name} raised {type(exc).__name__}"
            raise


def _own_vmap_rule(cls: Any) -> bool:
    """Whether an autograd.Function class defines its own ``vmap`` rule (found in its classes'
    dictionaries, no attribute lookup of its metaclass's)."""
    if not isinstance(cls, type):
        return True
    for c in _MRO(cls):
        got = vars(c).get("vmap")
        if got is not None:
            return got is not _FUNCTION_VMAP
    return False


_MRO = type.__dict__["__mro__"].__get__
_FUNCTION_VMAP = vars(torch.autograd.Function)["vmap"]
_CUSTOM_FUNCTION_CALL = torch._functorch.autograd_function.custom_function_call


def _per_example_grad_fn(model: nn.Module, loss_fn: LossFn) -> _GradFn:
    """``(params, xs, ys) -> ({name: (b, *shape)}, losses (b,))`` for one chunk."""
    watch: list[_Raised] = []

    def example_loss(params: dict[str, Tensor], x: Any, y: Any) -> tuple[Tensor, Tensor]:
        with watch[-1], _parameters_replaced(model, params):
            out = call_model(model, map_batch(_one, x))
            loss = _check_example_loss(loss_fn(out, map_batch(_one, y)))
        return loss, loss.detach()

    fn = grad(example_loss, has_aux=True)

    def run(params: dict[str, Tensor], xs: Any, ys: Any) -> tuple[dict[str, Tensor], Tensor]:
        # batch dimension 0 of every tensor leaf; None leaves (no data) are passed as they are
        watch.append(_Raised())
        # contiguous leaves: each example then owns one contiguous range of the storage, and
        # functorch refuses an as_strided view reaching beyond it (a column-major batch gave
        # every example a view spanning the others: as_strided with contiguous strides read
        # them, 3.17 C under auto; sixty-seventh hostile review)
        xs, ys = map_batch(_contiguous, xs), map_batch(_contiguous, ys)
        try:
            with no_compiled_autograd():
                got = vmap(fn, in_dims=(None, _in_dims(xs), _in_dims(ys)),
                           randomness="different")(params, xs, ys)
        finally:
            mode = watch.pop()
        mode.refuse("vmap engine")
        if mode.conv_moved:
            raise UnsupportedModelError(f"vmap engine: {MOVED}")
        if mode.threads_moved:
            raise UnsupportedModelError(f"vmap engine: {THREADS_MOVED}")
        if mode.numerics_moved:
            raise UnsupportedModelError(f"vmap engine: {NUMERICS_MOVED}")
        if mode.py_dispatcher:
            raise UnsupportedModelError(f"vmap engine: {PY_DISPATCHER}")
        if mode.custom_vmap is not None:
            raise UnsupportedModelError(
                f"vmap engine: the autograd.Function {mode.custom_vmap} has a vmap rule of its "
                "own (a vmap staticmethod): torch.func hands it the whole batch, so it can mix "
                "the examples (hundred-and-eighth hostile review: every row given example 0's, "
                "3.94 C under auto); use generate_vmap_rule=True, engine 'naive', or a model "
                "without it")
        if mode.raised is not None:
            raise UnsupportedModelError(
                f"vmap engine: an operation of the forward or loss raised an error that the "
                f"model caught ({mode.raised}): vmap runs the model's Python once for every "
                "example of a call, so an error caused by one example's values would change "
                "every example's computation. Let such errors propagate, or use engine 'naive'")
        return got

    return run


def _contiguous(t: Tensor) -> Tensor:
    return t.contiguous()


def _in_dims(tree: Any) -> Any:
    if isinstance(tree, Tensor):
        return 0
    return pytree.tree_map(lambda v: None if v is None else 0, tree, is_leaf=lambda v: v is None)


def _one(t: Tensor) -> Tensor:
    return t.unsqueeze(0)


def _per_example_losses(model: nn.Module, loss_fn: LossFn, xs: Any, ys: Any, b: int) -> Tensor:
    losses = loss_fn(call_model(model, xs), ys)
    if losses.ndim == 0 or losses.shape[0] != b:
        from dpclip.engine.errors import loss_shape_error

        raise loss_shape_error(losses.ndim)
    return losses.reshape(b, -1).sum(1)
