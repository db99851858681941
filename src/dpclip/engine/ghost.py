"""The ghost engine: per-example gradient norms without per-example gradients, and the clipped sum
by book-keeping, from ONE backward pass.

One call of :meth:`GhostEngine.compute` does, per physical chunk of the batch:

1. a forward pass with forward hooks (registered for this call only, removed in a ``finally``) on
   every layer that owns a trainable parameter; each hook stores the layer's input ``a`` and the
   autograd gradient edge of its output (not the output tensor: see ``_Call``). A plain
   ``nn.Sequential`` chain (``_plain_chain``) is run entry by entry instead, recording the same
   calls without hooks;
2. ONE backward pass of the summed per-example loss, as ``torch.autograd.grad(sum_i loss_i,
   edges)`` computes it, that asks for the gradients ``b`` with respect to the layers' OUTPUTS
   only: autograd then skips every parameter-gradient product, which is exactly the work that
   book-keeping redoes with weights (Bu et al. 2023, "book-keeping"). The engine calls the graph's
   nodes itself (:mod:`dpclip.engine.hook_free`), so that no hook attached to a node by the
   forward or the loss runs (autograd lets Python list none of them);
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
  ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` there get theirs from the time-step rule instead (the
  gradients at their recorded projections, no replay: :class:`dpclip.engine.recurrent.
  TimeStepRule`; ``engine_info["time_step_rule"]`` names them).
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
raises :class:`~dpclip.engine.errors.UnsupportedModelError` naming the layer. With
``fallback="vmap"`` (``auto``) the engine is decided once per model on a PUBLIC probe batch
before the model sees private data (``GhostEngine._decided``): a refused probe runs the ``vmap``
engine from the first step, recorded in ``EngineResult.engine_info``; a private step refused
after an accepted probe stops the run (docs/engines.md, "The engine is decided before the model
sees private data").

Separability (per call): the forward and the loss run under
:class:`~dpclip.engine.separable.SeparabilityTracer`; the per-example losses and every hooked layer's
input must be proved row separable (batch in dimension 0, no example mixing), and the autograd graph
must hold no custom ``autograd.Function``. A ruled layer may receive each example in ``k``
consecutive rows (layout ``(0, k)``: augmentation multiplicity's K copies, a batch flattened with
another dimension): its output is marked ``(0, k)`` and its rule reads example ``i`` from those
rows as from ``k`` times the positions (``ghost_rules._fold_rows``, ``_Call.group``). A model that mixes examples (``x - x.mean(0)``, a softmax
or roll over the batch) or hands a layer the batch in another dimension (sequence-first, even with
``T == B``) is refused or, with ``fallback="vmap"``, run on ``vmap`` (recorded). A plain
``nn.Sequential`` of known ``torch.nn`` classes (``_KNOWN_MODULES``) is proved from the modules'
semantics instead, at every batch size, with configuration and input rank checked per call
(docs/engines.md, "Separability without a trace"); the loss is traced on every call.

Inputs and targets may be tensors or tuples/dicts of tensors (:mod:`dpclip.engine.batch`); every
leaf is marked as example data for the trace.

Every chunk runs on a multiple of 32 rows (:func:`dpclip.engine.batch.padded_rows`): its examples,
then copies of its first example (``pad_rows`` for every leaf). The copies are weighted 0 and the
strategy never sees their norms or losses (the reported loss is the real examples': a copy's may
differ, by dropout, or be non-finite). torch's CPU kernels pick their code by the number of rows
(MKL's products of one output column or of few rows, reductions with the batch innermost, a
convolution of one example), so an example's computed gradient depended on how many others shared
its chunk (eightieth hostile review: up to 5.1 C through a zero-variance LayerNorm); with a row
count that is always a multiple of 32 and the copies after the real examples, no real example
lies in a kernel's leftover rows (docs/engines.md, "Rounding that depends on the batch size").
This also makes a chunk of one a batch (the earlier rule ran a chunk of one as two): it is proved,
matched against the proof and watched exactly as a batch is (the batch-size proof cannot run at
one row: export specialises size 1), and the engine's verdict on a model does not depend on
whether a chunk has one example: a model that keeps a value computed from the example with torch
functions and Python dispatch both off, or writes it so into a buffer, is refused at one example
as at many (it was accepted at one: LOO 2.70 C), and a batch reduction (``x - x.mean(0)``) is
refused at every chunk size. The cost: up to 31 extra rows per chunk (none at batch sizes that
are multiples of 32; ``benchmarks/results/row_block_cpu.md``).

Rounding: the norms passed to ``weight_fn`` (and reported) are upper bounds of the norms of the
vectors actually summed, rounding included (:class:`_Rounding`, ``_Rule.bound_sq``,
``_position_bound_sq``; docs/engines.md, "Privacy").

References: I. Goodfellow, "Efficient per-example gradient computations", 2015 (2-D linear rule);
X. Li, F. Tramer, P. Liang, T. Hashimoto, "Large language models can be strong differentially
private learners", ICLR 2022 (ghost clipping for sequences); Z. Bu, J. Mao, S. Xu, "Scalable and
efficient training of large convolutional neural networks with differential privacy", NeurIPS 2022
(mixed ghost clipping for convolutions); Z. Bu, Y.-X. Wang, S. Zha, G. Karypis, "Differentially
private optimization on large model at small cost", ICML 2023 (book-keeping).

Code map: this module holds the model scan, :class:`GhostEngine` (chunks, the norms and the
weighted sum of a chunk: ``_GroupNorms``, ``_weighted_sums``) and :class:`AutoEngine`;
:mod:`dpclip.engine.ghost_rules` one rule per layer type with its rounding bound;
:mod:`dpclip.engine.ghost_forward` the recorded forward and the separability proof around it.
"""

from __future__ import annotations
from dpclip.engine import _cm
import contextvars
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from dpclip._ident import ident
from dpclip.engine._common import (
    HALF,
    ChunkReducer,
    StepWeights,
    _Rounding,
    apply_weight_fn,
    smallest_subnormal,
    underflow_margin,
    exact_float32,
    batch_chunks,
    check_batch,
    check_chunk_size,
    check_per_example_model,
    check_weight_fn,
    out_dtype,
    sum_dtype,
    wide_requested,
)
from dpclip.engine.base import EngineResult, LossFn, ParamGroups, WeightFn
from dpclip.engine.conv_backends import fixed_conv_backends
from dpclip.engine.batch import (
    batch_leaves,
    call_model,
    map_batch,
    note_padded,
    pad_rows,
    padded_rows,
)
from dpclip.engine.errors import PrivateBufferError, UnsupportedModelError, quote_error
from dpclip.engine.op_entry import no_compiled_autograd
from dpclip.engine.vmap import VmapEngine
from dpclip.engine.saved_check import all_still, all_true, fingerprints, still
from dpclip.engine.past_batches import mark_past_batch
from dpclip.engine.plain_module import ambient_user_code
from dpclip.engine.per_layer import (
    EmbeddingLookup,
    PerLayerNotProved,
    PerLayerUnsupported,
    check_module_windows,
    module_grads,
    own_param,
    scale_grads,
)
from dpclip.engine.batch_symbol import data_independent_paths, method_caches_cleared
from dpclip.engine.tied import TiedUse, tied_norm_bound
from dpclip.engine.ghost_rules import (
    SUPPORTED_LAYERS,
    _BK_BLOCK,
    _Call,
    lookup_call,
    _Conv1DRule,
    _EMBED_GRAM_MAX_LEN,
    _EmbeddingRule,
    _LinearRule,
    _MODULE,
    _NP_ABS,
    _NP_BOOL,
    _NP_EMPTY,
    _NP_GREATER,
    _NP_MUL,
    _from_numpy,
    linear_ghost_key,
    linear_ghost_parts,
    _Owner,
    _SMALL_REDUCTION,
    _Scan,
    _Weights,
    _bk_blocks,
    _kept_sum,
    widen64,
    _rows,
    _rule_for,
    _sq,
    layer_config,
)
from dpclip.engine.hook_free import hook_free_grad
from dpclip.engine.library_code import library_changed
from dpclip.engine import torch_names, views
from dpclip.engine.generators import OwnGenerators, default_generators
from dpclip.engine.compiled import blocked as graph_blocked
from dpclip.engine.isolation import Isolated, check_structure, engine_only
from dpclip.engine.state_guard import state_guard
from dpclip.engine.ghost_forward import (
    CompiledStep,
    _closed_chain,
    _NotTheProvedProgram,
    _RuntimeUnsupported,
    _batched_rank,
    _check_losses,
    _forward,
)

__all__ = ["AutoEngine", "GhostEngine", "NORM_MODES", "SUPPORTED_LAYERS", "ghost_support",
           "register_view"]

#: per-layer norm strategies: ``mixed`` (cost rule, default), ``ghost`` (Gram matrices wherever a
#: layer has a ghost rule) and ``direct`` (per-example gradients formed and kept); results agree to
#: float rounding, the choice only changes speed and memory.
NORM_MODES = ("mixed", "ghost", "direct")
_FALLBACKS = (None, "vmap")

#: a parameter used by several calls (tied weights) has its per-example gradient formed, exactly,
#: while its ``numel`` is at most this many floats (memory ``B * numel``); beyond it (GPT-2's
#: 38M-entry ``wte`` tied to ``lm_head``), the norm is bounded by the sum of the uses' norm bounds
#: (triangle inequality) or, where the uses have a cross-term rule, exactly
#: (:mod:`dpclip.engine.tied`). The choice depends on the parameter alone, never on the batch
#: size: a choice by ``B * numel`` would change every example's norm, hence weight, when one
#: example is added or removed (the realised batch size is private)
_TIED_FORM_MAX_NUMEL = 1 << 16


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
    absorbed: set[int] = set()  # children whose parameters their parent's per-layer calls own
    for qual, mod in model.named_modules():
        if isinstance(mod, _BatchNorm):
            batchnorm = True
        if ident(mod) in absorbed:
            continue
        own_params = dict(mod._parameters)
        for child, attr, p in _read_by_parent(mod):
            own_params[f"{child}.{attr}"] = p
            absorbed.add(ident(mod._modules[child]))
        if not own_params:
            continue
        roles: list[str] = []
        pnames: list[str] = []
        for attr, p in own_params.items():
            if p is None:
                continue
            pid = ident(p)
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
        odd = [a for a, p in own_params.items() if p is not None and p.requires_grad
               and not p.is_floating_point()]
        if odd:  # (a complex weight's norms skipped the underflow flush and dropped their
            # imaginary parts: one example summed unclipped, 1.15e6 C at C = 1e-8; hundred-and-
            # forty-ninth hostile review)
            reasons.append(f"{where!r} ({type(mod).__name__}): trainable parameter(s) "
                           f"{', '.join(odd)} of a complex dtype (the ghost rules bound real "
                           "gradients only; use engine 'vmap' or real parameters)")
            continue
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
    # a ruled layer's output is its own per-example result only while what its forward looks
    # up by name is torch's own (a replaced F.linear runs inside it untraced)
    ruled = {type(o.module) for o in owners if o.rule is not _MODULE}
    if ruled and library_changed(ruled) is not None:
        for o in owners:
            why = library_changed((type(o.module),)) if o.rule is not _MODULE else None
            if why:
                reasons.append(f"{o.name!r} ({type(o.module).__name__}: {why})")
        owners = [o for o in owners if o.rule is _MODULE or not library_changed(
            (type(o.module),))]
    return _Scan(params, tuple(owners), tuple(reasons), batchnorm,
                 {ident(o.module): o for o in owners}, by_param,
                 tuple(o.name for o in owners if o.rule is _MODULE))


def _read_by_parent(mod: nn.Module) -> list[tuple[str, str, Tensor]]:
    """``(child, attr, parameter)`` for the parameters of a child that ``mod``'s forward reads
    itself without calling the child: ``nn.MultiheadAttention`` passes ``out_proj.weight`` and
    ``out_proj.bias`` to ``F.multi_head_attention_forward``, which applies them with ``F.linear``;
    its ``out_proj`` (a Linear) is never called, so its rule would see no call and the parameters
    would be used outside their owner. They are owned by the attention's per-layer calls instead
    (roles ``out_proj.weight``, ``out_proj.bias``: ``per_layer.own_param``), whose replay
    differentiates them with the rest; ``per_layer.check_module_windows`` still checks that every
    use lies inside those calls (a subclass that calls ``out_proj`` elsewhere is refused there).
    Only a child Linear with nothing below it and no hooks of its own."""
    if not isinstance(mod, nn.MultiheadAttention):
        return []
    child = mod._modules.get("out_proj")
    if not isinstance(child, nn.Linear) or child._modules or child._forward_hooks or \
            child._forward_pre_hooks:
        return []
    return [("out_proj", attr, p) for attr, p in child._parameters.items() if p is not None]


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


#: the autograd node of a Python ``autograd.Function`` (any class on ``_FunctionBase``: a node
#: class set as a Function's ``_backward_cls`` deriving from it directly, named like a built-in
#: node, passed as one; hundred-and-sixty-second hostile review, 4.23 C)
_CUSTOM_FUNCTION = torch._C._FunctionBase


#: the last release's fingerprints of one engine call (GhostEngine.compute compares them again)
_LAST_PRINTS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "dpclip_ghost_last_prints", default=None)


def _release_last(model: nn.Module, carry: list[Any]) -> None:
    """Release the last chunk's tensors, its rules' reads done, inside the chunk's isolation: a
    finalizer they run (user code) that leaves a Python attribute or a torch setting changed is
    refused and undone by the isolation; one that writes a parameter or buffer through torch
    moves its version, refused here (twenty-fifth hostile review: released after the isolation,
    a value from this step's data reached the next step, 2.33 times the sensitivity). Their
    bytes are compared too, not only their versions: a write through ``.data`` moves no version
    (seventy-second hostile review: 5.15 C across steps through ``engine.compute``)."""
    state = [t for t in itertools.chain(model.parameters(), model.buffers())]
    versions = [t._version for t in state]
    prints = fingerprints(state)
    final = _LAST_PRINTS.get()
    if final is not None:  # (compared again once the engine call has dropped everything)
        final.append((state, prints))
    carry.clear()
    if any(t._version != v for t, v in zip(state, versions)) or not all_still(state, prints):
        raise _NotTheProvedProgram(
            "a parameter or buffer of the model was written after the step's reads, by code "
            "that ran when the step released its tensors (a weakref.finalize or __del__ of an "
            "object kept with them): the next step would read a value from this step's data")


def _time_step(c: _Call) -> bool:
    """Whether a per-layer call is a recurrent layer's taken by the time-step rule
    (:class:`dpclip.engine.recurrent.TimeStepRule`)."""
    return c.fast is not None and not isinstance(c.fast, (tuple, EmbeddingLookup))


def _kept(c: _Call, batch: int) -> dict[str, Tensor]:
    """The per-example gradients of a per-layer call's own parameters: by the time-step rule (a
    recurrent layer), an elementwise scale, or the replay of the call's proved operations."""
    if _time_step(c):
        return c.fast.grads(c.mod, batch, c.owner.name)
    if isinstance(c.fast, EmbeddingLookup):  # (rows per example: the replay; else lookup_call)
        return module_grads(c, batch)
    return scale_grads(c, batch) if c.fast is not None else module_grads(c, batch)


def _counted_elsewhere(c: _Call) -> list[int]:
    """The outputs of a per-layer call that give the replay no gradient: a leaf made in the call
    (detached, then ``requires_grad_``), and those whose gradient is already part of another
    output's: the
    gradient autograd gives at an output's edge is the whole gradient of that tensor, through
    every later use, including another returned output computed from it inside the call (``o``
    and ``o[:, :2]``, the pieces of ``o.chunk(2)`` with ``o``) or the same tensor returned twice.
    Such an output's own gradient is then in the other's: it is not given to the replay again.
    The call's nodes are those created between its pre-hook and its hook."""
    start, end = c.window
    keys = [(e.node, e.output_nr) if e.node is not None else None for e in c.oedges]
    own = {ident(own_param(c.mod, r)) for r in c.owner.roles}
    got = []
    for j, key in enumerate(keys):
        if key is None:
            continue
        var = getattr(key[0], "variable", None)
        if var is not None and ident(var) not in own:
            # a leaf made in the call (``o.detach().requires_grad_()``): no gradient of the
            # module's parameters flows through it, though the replay would differentiate
            # through the recorded detach (twenty-fourth hostile review: wrong gradients)
            got.append(j)
            continue
        if key in keys[:j]:  # the same tensor returned again
            got.append(j)
            continue
        others = {k for i, k in enumerate(keys) if i != j and k is not None}
        stack, seen = [key[0]], set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            hit = False
            for n, nr in node.next_functions:
                if n is None:
                    continue
                if (n, nr) in others:
                    hit = True
                    break
                if start is not None and start < n._sequence_nr() < end:
                    stack.append(n)
            if hit:
                got.append(j)
                break
    return got


def _graph_param_uses(root: Any, wanted: dict[int, str],
                      indeg: dict[Any, int] | None = None,
                      targets: dict[Any, dict[int, int]] | None = None) -> dict[str, int]:
    """How many autograd edges lead into each wanted parameter's AccumulateGrad node (``indeg``:
    filled with every node's number of incoming edges, when given; ``targets``: node -> {output
    number: edges into it}, filled for the nodes it names).

    Raises :class:`_RuntimeUnsupported` on a node of a custom ``torch.autograd.Function`` (or a
    module backward hook, which is one): its backward is user code that the separability trace of
    the forward cannot see, and it could mix the examples' gradients."""
    if indeg is None:
        indeg = {}
    indeg[root] = 0
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
        for nxt, nr in edges:
            if nxt is None:
                continue
            if targets and nxt in targets:
                by_nr = targets[nxt]
                by_nr[nr] = by_nr.get(nr, 0) + 1
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
            name = wanted.get(ident(var))
            if name is not None:
                uses[name] = indeg[fn]
    return uses


# --------------------------------------------------------------------------------- the engine


def _refuse_rewritten_inputs(live: list[_Call]) -> None:
    """Raise :class:`_NotTheProvedProgram` if a tensor the engine is about to read (a ruled
    layer's input; a per-layer call's arguments and scale operand, before the recomputation) is
    not what the call used: rewritten after it by a path that left no trace (an in-place write
    with Python dispatch off, then its version counter set back: third hostile review, LOO
    1.54-1.57 C; :mod:`dpclip.engine.saved_check`). Not a vmap fallback: whether it is rewritten
    can depend on the batch size."""
    # (a write that moved the version counter before the backward is refused by the version
    # checks, with their own message; one that moved it later, by user code that ran after the
    # forward, e.g. the __del__ of an object the engine dropped after the backward (twentieth
    # hostile review: LOO 1.84 C), is refused here; then the bytes, with the counter unchanged)
    for c in live:  # a ruled layer's configuration, read by its rule next (checked at its call)
        if c.outs is None and c.owner.config is not None and \
                layer_config(c.mod) != c.owner.config:
            raise _NotTheProvedProgram(
                f"layer {c.owner.name!r} ({type(c.mod).__name__}) has another configuration (a "
                "parameter or buffer swapped or written, its padding, eps, ...) after the forward "
                "pass than when it ran, changed by code that ran after the forward and loss (e.g. "
                "a finalizer of an object the step dropped): its rule would read the per-example "
                "gradient with values the layer never used")
    # (a per-layer call's kept tensors have their own version checks where they are read)
    for c in live:
        for t, v, _ in (c.a_print or ()) if c.outs is None else ():
            if t._version != v:
                raise _NotTheProvedProgram(
                    f"the input of layer {c.owner.name!r} ({type(c.mod).__name__}) was modified "
                    "in place after the layer used it, by code that ran after the forward pass "
                    "and loss (e.g. a __del__ or a weakref finalizer of an object the step "
                    "dropped), so the layer's per-example gradient would be read from values it "
                    "never saw")
    kept = [(c, t, p) for c in live for t, v, p in c.a_print or () if t._version == v]
    for c in live:
        c.a_print = None
    if all_still([t for _, t, _ in kept], [p for _, _, p in kept]):
        return
    for c, t, p in kept:
        if not all_true([still(t, p)]):
            what = "input" if c.outs is None else "argument"
            raise _NotTheProvedProgram(
                f"the {what} of layer {c.owner.name!r} ({type(c.mod).__name__}) was rewritten "
                "after the layer used it by a write that left its version counter unchanged "
                "(through an alias made with set_, or unseen: torch._C._DisableTorchDispatch, "
                "_unsafe_set_version_counter, raw memory), so the layer's per-example gradient "
                "would be read from values it never saw")


class _Refused(Exception):
    """The ghost engine refuses the model (a static reason, or a run-time one: not proven
    separable, a parameter used outside its layer, ...); ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class _Verdict:
    """``fallback="vmap"``'s choice for one model, made on a public probe batch: ``reason`` None
    (ghost) or the ghost engine's refusal of the probe (vmap, recorded)."""

    reason: str | None


#: the engine ``fallback="vmap"`` (``auto``) chose for each model, on a public probe batch,
#: before the model saw private data; kept for the life of the model object. Keyed by IDENTITY
#: (``id`` and a weak reference), never by the model's ``__hash__`` / ``__eq__``: user code that
#: made them vary would otherwise get a new probe after private steps on ghost, and with it a
#: vmap verdict that reads what those steps left
_VERDICTS: dict[int, tuple["weakref.ref[nn.Module]", _Verdict]] = {}


def register_view(cls: type, attr: str) -> None:
    """Declare ``cls`` a per-step view of the model held in its attribute ``attr`` (the verdict
    of ``fallback="vmap"`` is then kept for that model; the engines' walks of the module tree go
    on into it: :mod:`dpclip.engine.views`)."""
    views.register_view(cls, attr)


_owner = views.owner


def _verdict_of(model: nn.Module) -> _Verdict | None:
    model = _owner(model)
    got = _VERDICTS.get(ident(model))
    return got[1] if got is not None and got[0]() is model else None


def _keep_verdict(model: nn.Module, verdict: _Verdict) -> None:
    model = _owner(model)
    key = ident(model)
    _VERDICTS[key] = (weakref.ref(model, lambda _, key=key: _drop_verdict(key)), verdict)


def _drop_verdict(key: int) -> None:
    got = _VERDICTS.get(key)
    if got is not None and got[0]() is None:  # (not a newer model that reuses the id)
        del _VERDICTS[key]


#: the per-layer name of the root module
_ROOT = "<root>"

#: the probe's batch size: public, and more than one example so that the step is traced
_PROBE_BATCH = 2


def _public_probe(tree: Any) -> Any:
    """A public batch of ``tree``'s structure: every tensor leaf replaced by zeros (``False``) of
    its dtype, device and trailing shape, with ``_PROBE_BATCH`` rows. Zeros are a valid index of
    every embedding table and class of every label; no value of the private batch, and not its
    size, reaches it."""
    return map_batch(lambda t: torch.zeros((_PROBE_BATCH, *t.shape[1:]), dtype=t.dtype,
                                           device=t.device), tree)


class _StepState:
    """Copies of a step's state when a graph's first step begins: every parameter and buffer
    of the model (by name, duplicates included) and every tensor of the batch, with their
    layouts; :meth:`changed` names the first that no longer holds them (bits compared: -0.0 is
    not 0.0, NaN payloads count)."""

    __slots__ = ("_kept",)

    def __init__(self, model: nn.Module, inputs: Any, targets: Any) -> None:
        self._kept = [(what, t, _copy(t)) for what, t in _state_tensors(model, inputs, targets)]

    def changed(self, model: nn.Module, inputs: Any, targets: Any) -> str | None:
        now = _state_tensors(model, inputs, targets)
        if len(now) != len(self._kept):
            return "the model's parameters or buffers (their number)"
        with _cm.no_grad():
            for (what, t, kept), (what2, t2) in zip(self._kept, now):
                if what2 != what or t2 is not t or t.shape != kept.shape or \
                        t.dtype != kept.dtype or t.stride() != kept.stride() or \
                        not _same_bits(t, kept):
                    return what
        return None


def _state_tensors(model: nn.Module, inputs: Any, targets: Any) -> list[tuple[str, Tensor]]:
    got = [(f"parameter {n!r}", p) for n, p in model.named_parameters(remove_duplicate=False)]
    got += [(f"buffer {n!r}", b) for n, b in model.named_buffers(remove_duplicate=False)
            if isinstance(b, Tensor)]
    got += [("a tensor of the batch", t) for t in batch_leaves(inputs) + batch_leaves(
        targets, "targets") if isinstance(t, Tensor)]
    return got


def _copy(t: Tensor) -> Tensor:
    with _cm.no_grad():
        return t.detach().clone(memory_format=torch.preserve_format)


def _same_bits(a: Tensor, b: Tensor) -> bool:
    from dpclip.engine.proved_program import _equal

    return bool(_equal(a.detach(), b))


def _unit_weights(norms: Tensor) -> Tensor:
    """The probe's weight function (the strategy's is not called on the probe)."""
    return torch.ones_like(norms)


def _check_options(engine: GhostEngine | AutoEngine, owner: str) -> None:
    """Validate the options GhostEngine and AutoEngine share (``max_physical_batch``,
    ``norm_mode``), naming ``owner`` in the error."""
    if engine.max_physical_batch is not None:
        check_chunk_size(engine.max_physical_batch, owner)
    if engine.norm_mode not in NORM_MODES:
        raise ValueError(f"{owner}: norm_mode must be one of {NORM_MODES}, got "
                         f"{engine.norm_mode!r}")


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
            ``None`` (default): chunks of at most 4096 examples (one chunk for smaller batches).
            The norms' rounding factor is taken for this public size, never the realised batch.
        norm_mode: ``"mixed"`` (default: per-layer choice by cost), ``"ghost"`` or ``"direct"``
            (see :data:`NORM_MODES`).
        fallback: ``None`` (default): a model with a layer the engine does not support raises
            :class:`~dpclip.engine.errors.UnsupportedModelError` naming it; ``"vmap"``: the
            engine is decided once per model on a public probe batch (two examples of zeros)
            before the model sees private data; a model refused there runs on ``vmap`` from the
            first step and ``engine_info`` says so; a private step refused after an accepted
            probe stops the run (never a vmap fallback).

    Privacy: each example contributes a vector ``V_i`` with ``||V_i|| <= w_i n_i``, ``n_i`` the
    reported norm: an upper bound of the norm of what is actually summed, rounding included, so
    the strategy's sensitivity bound holds. The forward runs on the whole chunk, so it is traced and
    must be proved per-example separable (mixing models and sequence-first layers are refused or
    fall back to ``vmap``); dropout draws independent masks per example, as under ``vmap``. Hooks live for one call only; nothing is
    attached to modules or parameters, ``p.grad`` is not touched.
    """

    name: ClassVar[str] = "ghost"
    per_example: ClassVar[bool] = True
    #: run the proof's graph instead of the user's code (:class:`CompiledEngine`)
    _compiled: ClassVar[bool] = False
    #: where the graph cannot be proved or run, the traced path (``auto``) instead of a refusal
    _prefer: ClassVar[bool] = False

    max_physical_batch: int | None = None
    norm_mode: str = "mixed"
    fallback: str | None = None

    def __post_init__(self) -> None:
        _check_options(self, type(self).__name__)
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"{type(self).__name__}: fallback must be None or 'vmap', got "
                             f"{self.fallback!r}")

    # ------------------------------------------------------------------------------- public

    def compute(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                weight_fn: WeightFn | None, groups: ParamGroups) -> EngineResult:
        final: list[Any] = []
        token = _LAST_PRINTS.set(final)
        try:
            # (no user code runs between the engine's own operations; convolutions on one
            # backend whatever the batch size: dpclip.engine.conv_backends)
            with engine_only(), fixed_conv_backends():
                res = self._compute(model, loss_fn, inputs, targets, weight_fn, groups)
        finally:
            _LAST_PRINTS.reset(token)
        # every reference of the engine to the step's batch is gone now (a chunk's padding
        # copies, the chunks' slices): what a finalizer attached to one wrote into the model's
        # parameters or buffers when it ran is seen here (seventy-fourth hostile review: a weight
        # written through .data after the last release's check reached the next steps, 4.76 C)
        for state, prints in final:
            if not all_still(state, prints):
                raise UnsupportedModelError(
                    f"{self.name} engine: a parameter or buffer of the model was written after "
                    "the step's last check, by code that ran when the engine released the "
                    "step's batch (a weakref.finalize or __del__ attached to an input or a "
                    "tensor of the step): the next step would read a value from this step's "
                    "data. Keep the forward free of finalizers")
        return res

    def _compute(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                 weight_fn: WeightFn | None, groups: ParamGroups) -> EngineResult:
        check_structure(model, f"{self.name} engine")  # (before any of the model's methods runs)
        weight_fn = check_weight_fn(weight_fn, self.name)
        if self.fallback == "vmap":
            check_batch(inputs, targets, self.name)  # (bad input: an error before the probe)
            return self._decided(model, loss_fn, inputs, targets, weight_fn, groups)
        try:
            return self._run(model, loss_fn, inputs, targets, weight_fn, groups)
        except _Refused as exc:
            raise self._refusal_error(exc.reason) from None

    # ------------------------------------------------------------------------------ helpers

    def _run(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
             weight_fn: WeightFn, groups: ParamGroups) -> EngineResult:
        """One step on the ghost engine; a refusal of the model raises :class:`_Refused` (the
        caller decides: an error, or the verdict of a probe)."""
        batch = check_batch(inputs, targets, self.name)
        scan = _scan(model)
        if scan.batchnorm:
            check_per_example_model(model, self.name)
        params = scan.params
        if not _partitions(groups, params):
            groups.validate(model)  # raises, naming the missing / unknown / repeated names
        if scan.reasons:
            raise _Refused("unsupported layer(s): " + "; ".join(scan.reasons))
        # dp_step's weight function: this engine guards the model's state itself, except in a
        # closed program (known modules, a known loss, a strategy of dpclip's own: no user code
        # runs in the step, so none can write private data into the model's state)
        step = type(weight_fn) is StepWeights
        chain = _closed_chain(model, scan, loss_fn, inputs, targets) \
            if step and weight_fn.closed else None  # type: ignore[union-attr]
        with state_guard(model, "dp_step") if step and chain is None \
                else _cm.nullcontext():
            return self._guarded(model, loss_fn, inputs, targets, weight_fn, groups, batch, scan,
                                 chain)

    def _guarded(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                 weight_fn: WeightFn, groups: ParamGroups, batch: int, scan: Any,
                 chain: list[nn.Module] | None) -> EngineResult:
        """:meth:`_run` after the static checks; ``chain``: a closed program's known chain
        (checked once for the step: nothing else runs between its chunks)."""
        params = scan.params
        if not batch or not params:
            reducer = ChunkReducer(params, groups, weight_fn, self.name, inputs)
            with _cm.no_grad():
                for rows, xs, ys in batch_chunks(inputs, targets, batch, self._chunk_size()):
                    reducer.add_chunk({}, _check_losses(loss_fn(call_model(model, xs), ys), rows))
            grads, norms, weights, loss_sum = reducer.result()
            return EngineResult(grads, norms, weights, loss_sum, self._info(None))
        compiled = CompiledStep(self._prefer, lambda: _StepState(model, inputs, targets)) \
            if self._compiled else None
        # (the caller's default generators before the step's chunks draw their seeds: a graph's
        # first step runs its chunks twice, and the graph pass draws the seeds the traced pass
        # drew, as a single pass would; nothing of the traced pass is released)
        rng = [(g, g.get_state()) for g in default_generators()] if compiled is not None \
            else None
        res = self._chunks(model, loss_fn, inputs, targets, weight_fn, groups, batch, scan,
                           chain, compiled)
        if compiled is not None and compiled.pending and weight_fn is not _unit_weights \
                and all(p.confirmed for p in compiled.pending) \
                and not (self._prefer and graph_blocked() is not None):
            # (auto, with user code around the step that no graph step runs under, a profiler:
            # the traced pass's sum is released, as on every step until that code is gone)
            # a graph's first step: its chunks ran on the traced path, whose checks refuse what
            # the graph does not show (a backward hook, a custom Function, a value of the batch
            # read through an escape) and whose match ties the graph to the model's own code;
            # the graph is adopted now, and the step's sum comes from the GRAPH, never from the
            # user's autograd graph, whose history the traced checks observe but user code with
            # torch's dispatch off could still rewrite (docs/engines.md, "Reviews 154-155":
            # nine reviews found one more such property to compare). The traced result is
            # dropped unreleased; the graph runs the same batch, on the state the step began
            # with: a parameter, buffer or batch tensor written by the traced pass's user code
            # where its own checks did not look (a finalizer in its backward, a cache's value
            # dropped when its chunk ended) would be read by the graph (hundred-and-sixty-fifth
            # hostile review: 8.0 to 13.7 C under auto and compiled)
            del res
            if compiled.state is not None:
                changed = compiled.state.changed(model, inputs, targets)
                compiled.state = None
                if changed is not None:
                    raise UnsupportedModelError(
                        f"{self.name} engine: {changed} changed while the graph's first step "
                        "ran the model's code for its checks (by code the model ran there: a "
                        "finalizer, a cache, a hook), before the graph runs the step; keep the "
                        "model's state and the batch unchanged in the forward and loss")
            for g, state in rng or ():
                g.set_state(state)
            res = self._chunks(model, loss_fn, inputs, targets, weight_fn, groups, batch, scan,
                               chain, CompiledStep(self._prefer, only=tuple(compiled.pending)))
        return res

    def _chunks(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                weight_fn: WeightFn, groups: ParamGroups, batch: int, scan: Any,
                chain: list[nn.Module] | None, compiled: CompiledStep | None) -> EngineResult:
        """The chunks of :meth:`_guarded`."""
        params = scan.params
        wide = wide_requested()  # (dp_step's: the float64 sums go to the release uncast)
        group_of = {n: g for g, mem in enumerate(groups.members) for n in mem}
        sums: dict[str, Tensor] | None = None
        all_norms, all_weights, loss_sum = [], [], 0.0
        carry: list[Any] = []  # the last chunk's tensors (see _chunk)
        #: per-layer modules taken by a structural rule: "time_step" (recurrent layers,
        #: recurrent.TimeStepRule) or "embedding_lookup" (per_layer.EmbeddingLookup)
        stepped: dict[str, str] = {}
        # the forward sees only the engine's copies of the batch (batch_chunks); the caller's
        # tensors are a past batch's data in later traces, as those copies are (a model that
        # reaches the batch some other way, keeps it in a global and reads it in a later step is
        # refused then)
        mark_past_batch(batch_leaves(inputs) + batch_leaves(targets, "targets"))
        try:
            chunks: list[Any] = list(batch_chunks(inputs, targets, batch,
                                                  self._chunk_size()))
            draws = chain is not None and any(_draws(m) for m in chain)
            for i in range(len(chunks)):
                rows, xs, ys = chunks[i]
                # user code runs isolated: generators of the chunk's own, and nothing it leaves
                # in the model's Python attributes or torch's settings (dpclip.engine.isolation;
                # a closed program runs no user code)
                # (and the model's method caches are empty when it starts and when it ends: a
                # value a private chunk cached, read by a later proof, was a constant there;
                # sixty-fourth hostile review, 2.05 C across steps)
                # (a closed program that draws, a Dropout in an nn.Sequential, draws from the
                # chunk's own generators too: its masks came from torch's public generator,
                # handed out by row position, so one example's presence moved every later row's
                # mask: LOO 4.5 C under auto, ghost and compiled through make_private, and the
                # public generator's state told the padded batch size; hundred-and-twenty-third
                # hostile review)
                with Isolated(model) if chain is None or draws else _cm.nullcontext() as iso, \
                        method_caches_cleared(model) if chain is None \
                        else _cm.nullcontext():
                    try:
                        part, norms, weights, loss = self._chunk(
                            model, scan, group_of, len(groups), loss_fn, xs, ys, rows,
                            weight_fn, chain, iso.gens if iso is not None else None, carry,
                            stepped, compiled)
                    finally:  # (a graph chunk paused the collector: back on inside the isolation)
                        if compiled is not None:
                            compiled.resume_gc()
                    if i == len(chunks) - 1 and carry:
                        _release_last(model, carry)
                    # the chunk's slices of the batch are released inside its isolation: a
                    # finalizer the forward attached to one ran when this method returned, outside
                    # every check, and installed a profile function that scaled the released sum
                    # (93.5 C under ghost and auto) or zeroed the noise (thirty-ninth review)
                    chunks[i] = None
                    del rows, xs, ys
                # the chunks' sums added in float64 (float32 ones: an accumulator in float32
                # rounded each addition on the grid of the running total, and removing one
                # example moved every later chunk's composition, so the others' sums rounded the
                # other way at every addition: 9.69 C at B = 2^20, 5.48 C at B = 65,536 with
                # max_physical_batch 32; hundred-and-fortieth hostile review); cast once at the end
                if sums is None:
                    sums = part
                else:
                    for n, g in part.items():
                        if sums[n].dtype == torch.float32:
                            sums[n] = sums[n].double()
                        sums[n] += g
                all_norms.append(norms)
                all_weights.append(weights)
                loss_sum += loss
        except _NotTheProvedProgram as exc:
            # never a fallback: the match can depend on the realised batch size, and the
            # fallback's per-example function is the real program's, not the proved one
            raise UnsupportedModelError(
                f"{self.name} engine: {exc}. This is not turned into a vmap fallback (whether a "
                "step matches could depend on the private batch size, and the engine would then "
                "be chosen by it); the run stops here. Make the forward and loss compute the same "
                "operations on every call, or use engine 'vmap' for this model") from None
        except _RuntimeUnsupported as exc:
            raise _Refused(str(exc)) from None
        finally:
            carry.clear()  # every chunk's reads are done
        assert sums is not None
        with exact_float32():  # (the float64 sums cast once, with gradual underflow; under
            # wide_sums, dp_step's, after the noise instead: _common.wide_sums)
            for n, g in sums.items():
                want = out_dtype(params[n].dtype, wide)
                if g.dtype != want and (g.dtype == torch.float64 or want == torch.float64):
                    sums[n] = g.to(want)
        if compiled is not None and weight_fn is not _unit_weights:
            # a graph whose first step this was (every chunk traced, the last release checked)
            # is adopted now; never on auto's public probe: the first private step is traced
            for plan, frozen in zip(compiled.pending, compiled.frozen):
                plan.confirm(frozen)
        norms = all_norms[0] if len(all_norms) == 1 else torch.cat(all_norms)
        weights = all_weights[0] if len(all_weights) == 1 else torch.cat(all_weights)
        info = self._info(None, scan.per_layer)
        if compiled is not None and compiled.ran:  # (the proved graph ran instead of the model)
            info["program"] = "compiled"
        if stepped:  # (which per-layer modules skipped the replay: decided by their structure)
            for key, kind in (("time_step_rule", "time_step"),
                              ("embedding_lookup", "embedding_lookup")):
                names = tuple(n for n in scan.per_layer if stepped.get(n) == kind)
                if names:
                    info[key] = names
        return EngineResult(sums, norms, weights, loss_sum, info, params)

    def _decided(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                 weight_fn: WeightFn, groups: ParamGroups) -> EngineResult:
        """``fallback="vmap"`` (``auto``): the engine is decided once per model, on a PUBLIC probe
        batch, before the model sees private data (docs/engines.md, "The engine is decided
        before the model sees private data"). A probe the ghost engine refuses: ``vmap`` from
        the start, recorded. A probe it accepts: ``ghost``, and a refusal of a private step
        later stops the run (never a vmap fallback: the ghost forward has then run the model on
        the whole private batch, and what it kept there ``vmap`` would read)."""
        verdict = _verdict_of(model)
        if verdict is None:
            # (dp_step's: the probe runs the model's code too; its state is guarded as the step's)
            with state_guard(model, "dp_step") if type(weight_fn) is StepWeights \
                    else _cm.nullcontext():
                verdict = self._probe(model, loss_fn, inputs, targets, groups)
            _keep_verdict(model, verdict)
        if verdict.reason is not None:
            # guarded on every call, dp_step's or not: vmap has no tracer, and a model that keeps
            # a tensor in an attribute would carry one chunk's or step's examples into the next
            # (a module attribute read by the next step of one example: LOO 2.70 C)
            with state_guard(model, "dp_step"):
                return self._vmap(model, loss_fn, inputs, targets, weight_fn, groups,
                                  verdict.reason)
        try:
            return self._run(model, loss_fn, inputs, targets, weight_fn, groups)
        except _Refused as exc:
            raise UnsupportedModelError(
                f"{self.name} engine: the ghost engine refused a private step at run time "
                f"({exc.reason}), after the public probe batch had chosen it for this model. "
                "This is not turned into a vmap fallback: the ghost forward has already run the "
                "model's code on the whole private batch, and whatever it kept there (a tensor, "
                "a Python number, a NumPy copy) vmap would read when it evaluates each example "
                "alone; the run stops here. Use engine 'vmap' for this model from the start "
                "(its fallback is decided on public data only before the first step)") from None

    def _probe(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
               groups: ParamGroups) -> _Verdict:
        """Run the ghost engine once on a public batch of the structure of ``inputs`` /
        ``targets`` (:func:`_public_probe`), with unit weights and the random generators
        restored after it; its refusal (a static one, a run-time one) is the verdict."""
        xs, ys = _public_probe(inputs), _public_probe(targets)
        cuda = sorted({t.device.index or 0 for t in list(model.parameters()) + list(
            model.buffers()) + batch_leaves(inputs, engine=self.name) if t.is_cuda})
        with torch.random.fork_rng(devices=cuda):
            try:
                res = self._run(model, loss_fn, xs, ys, _unit_weights, groups)
                reason = None
                if _ROOT in ((res.engine_info or {}).get("per_layer") or ()):
                    reason = self._root_cost(model, loss_fn, xs, ys, groups)
            except _Refused as exc:
                reason = exc.reason
            except UnsupportedModelError:
                raise  # the refusals that stop a run stop it on the probe too
            except (RuntimeError, IndexError) as exc:  # the model cannot take the probe's values
                reason = ("the ghost engine could not run the public probe batch (every input "
                          f"and target zero): {quote_error(exc)}")
        return _Verdict(reason)

    def _root_cost(self, model: nn.Module, loss_fn: LossFn, xs: Any, ys: Any,
                   groups: ParamGroups) -> str | None:
        """The cost rule of ``auto`` for a model whose ROOT module is on the per-layer path (a
        parameter used in the root's own forward: a learned position table added there): the
        per-layer path would replay the whole forward for each example, under ``vmap`` and the
        recomputation's checks, which is ``vmap``'s work and more (a 2-layer
        ``nn.TransformerEncoder`` classifier at batch 64 on a CPU: 8.7x the non-private step
        against vmap's 2.3x, benchmarks/results/torchnn_models_cpu.md). ``vmap`` then, if it runs
        the probe (the model's structure decides: public); else None (ghost)."""
        try:
            VmapEngine(max_physical_batch=2).compute(model, loss_fn, xs, ys, _unit_weights,
                                                     groups)
        except (RuntimeError, IndexError, UnsupportedModelError):
            return None
        return ("cost: the root module owns parameters used in its own forward (e.g. a learned "
                "position table added there), so the ghost engine's per-layer path would replay "
                "the whole forward for every example; vmap evaluates every example directly, "
                "faster. Move such a parameter into a submodule (an nn.Embedding on positions, "
                "or a module that adds it) to keep the ghost engine")

    def _info(self, fallback: str | None, per_layer: tuple[str, ...] = ()) -> dict[str, Any]:
        info = {"engine": "vmap" if fallback else "ghost", "requested": self.name,
                "fallback": fallback}
        if per_layer and not fallback:  # the modules that took the per-layer path (public names)
            info["per_layer"] = per_layer
        return info

    def _vmap(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
              weight_fn: WeightFn, groups: ParamGroups, reason: str) -> EngineResult:
        """The vmap engine on the whole batch, with ``reason`` (the probe's) recorded."""
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

    def _refusal_error(self, reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(
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
        chain: list[nn.Module] | None = None,
        gens: OwnGenerators | None = None,
        carry: list[Any] | None = None,
        stepped_names: dict[str, str] | None = None,
        compiled: CompiledStep | None = None,
    ) -> tuple[dict[str, Tensor], Tensor, Tensor, float]:
        """One chunk. ``compiled``: the step's compiled path (None: the traced path only); a
        graph whose first step this is runs traced and is adopted by :meth:`_guarded` once the
        whole step passed."""
        params = scan.params
        real = batch
        batch = padded_rows(real)  # copies of the first example after the chunk (module docstring)
        if batch != real:
            xs = map_batch(lambda t: pad_rows(t, batch), xs)
            ys = map_batch(lambda t: pad_rows(t, batch), ys)
        try:
            calls, losses, user_code = _forward(model, scan, loss_fn, xs, ys, batch, chain, gens,
                                                carry, compiled)
        except (UnsupportedModelError, PrivateBufferError):
            raise
        except (RuntimeError, ValueError, IndexError) as exc:
            if batch != real:  # (the model's own error, with what the engine changed)
                note_padded(exc, self.name)
            raise
        torch_names.check("after the forward and loss")  # (before the backward reads them)
        total = losses.sum()
        left = ambient_user_code()
        if left is not None:  # entered by the forward or loss and not left: the backward's ops
            raise _NotTheProvedProgram(  # would run it (third hostile review: LOO 3.73 C)
                f"{left} after the forward pass and loss (entered by them and not left): it "
                "would run user code on the backward's operations, which the separability proof "
                "cannot see. Leave every such context inside the forward or loss")
        for c in calls:
            o = c.owner
            if c.outs is not None:  # per-layer path: every output batch-first (or an RNN's
                rows = batch * c.group  # final states: the batch in dimension 1)
                bad = [t.ndim for t, d in zip(c.outs, c.batch_first)
                       if d is None or t.shape[d] != rows]
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
            rows = batch * c.group  # (c.group: rows per example, from the trace's layouts)
            d = getattr(c, "batch_dim", 0)  # (1: sequence-first, ghost_rules._sequence_first)
            if c.a.ndim <= d or c.a.shape[d] != rows or len(c.out_shape) <= d \
                    or c.out_shape[d] != rows:
                raise _RuntimeUnsupported(  # ranks, not shapes (the batch size is private)
                    f"layer {o.name!r} ({type(c.mod).__name__}) was called on a tensor of rank "
                    f"{c.a.ndim} (output rank {len(c.out_shape)}) whose first dimension is not "
                    "the batch; per-layer rules need batch-first inputs (e.g. expand position "
                    "indices to (B, T) before an Embedding, or give the layer a leading "
                    "dimension 1 that is broadcast later)")
        late: list[Any] = []  # what the calls held, released after the reads (below)
        live = [c for c in calls if c.edge is not None]
        modular = [c for c in live if c.outs is not None]
        try:
            if total.requires_grad and live:
                indeg: dict[Any, int] = {}
                # the per-layer calls' output nodes: their incoming edges are counted per output
                # number too (a multi-output node, e.g. split, whose other output escapes)
                targets = {e.node: {} for c in modular for e in c.oedges if e.node is not None}
                uses = _graph_param_uses(total.grad_fn, scan.by_param, indeg, targets)
                for c in live:
                    # an expanded batch-less call's per-example gradients are read at the
                    # expansion: its own output must reach the loss through it alone (a ._base
                    # of the expansion, or of a view of it, led around it: that gradient was
                    # silently left out; sixty-first hostile review)
                    if c.source is not None and indeg.get(c.source, 0) > 1:
                        raise _RuntimeUnsupported(
                            f"the output of layer {c.owner.name!r} ({type(c.mod).__name__}), "
                            "called without the batch dimension, reaches the loss other than "
                            "through the engine's expansion of it (e.g. through ._base of a view "
                            "of it): the per-example gradients read at the expansion would miss "
                            "that part; use the output itself")
                inputs: list[Any] = []
                for c in live:
                    inputs.extend(c.oedges if c.outs is not None else [c.edge])
                # a recurrent layer's projections (TimeStepRule): their gradients, after all
                stepped = [c for c in live if c.outs is not None and _time_step(c)]
                for c in stepped:
                    inputs.extend(c.fast.edges)
                with no_compiled_autograd():  # (a compiler would return the gradients)
                    if user_code:  # no hook of the graph runs (dpclip.engine.hook_free)
                        bs = hook_free_grad(total, inputs)
                    else:  # known modules and loss: no user code could reach the graph's nodes
                        bs = list(torch.autograd.grad(total, inputs, allow_unused=True))
                k = 0
                for c in live:
                    c.edge = None  # the graph is freed: no node references left behind
                    if c.outs is not None:
                        c.bs = list(bs[k:k + len(c.outs)])
                        # an output whose gradient another output's already holds (returned
                        # twice, or a view of another output): counted once (twenty-second and
                        # twenty-third hostile reviews: the replay summed it twice)
                        for j in _counted_elsewhere(c):
                            c.bs[j] = None
                        c.b = next((b for b in c.bs if b is not None), None)
                        k += len(c.outs)
                    else:
                        c.b = bs[k]
                        k += 1
                for c in stepped:
                    n = len(c.fast.edges)
                    c.fast.bs = list(bs[k:k + n])  # (released with c.fast)
                    k += n
                live = [c for c in live if c.b is not None]
            else:
                # no hooked call reached the loss: every trainable parameter the loss still
                # depends on is used outside its layer (a forward of F.linear(x, self.fc.weight)
                # alone gave zero sums, silently: thirty-eighth review)
                uses = _graph_param_uses(total.grad_fn, scan.by_param, None, {}) \
                    if total.requires_grad else {}
                live = []
            # every parameter must be used exactly by the hooked calls that reach the loss (the
            # per-layer path: by the nodes inside its calls, dpclip.engine.per_layer)
            modular = [c for c in live if c.outs is not None]
            count: dict[str, int] = {}
            seen: dict[str, int] = {}  # (the same, counting the autograd graph's uses)
            for c in live:
                if c.outs is None:
                    # (the compiled graph's uses of one batch-less lookup are one use of the
                    # table in the autograd graph: compiled._LookupThrough.graph_use)
                    once = getattr(c.rule, "graph_use", True)
                    for pn in c.owner.pnames:
                        count[pn] = count.get(pn, 0) + 1
                        if once:
                            seen[pn] = seen.get(pn, 0) + 1
            if modular:
                mod_names = {pn for c in modular for pn in c.owner.pnames}
                check_module_windows(modular, {pn: uses.get(pn, 0) for pn in mod_names},
                                     {pn: n for pn, n in count.items() if pn in mod_names},
                                     scan.by_param, indeg, targets)
                uses = {pn: n for pn, n in uses.items() if pn not in mod_names}
                count_ruled = {pn: n for pn, n in seen.items() if pn not in mod_names}
            else:
                count_ruled = seen
            if uses != count_ruled:
                bad = sorted(pn for pn in params if uses.get(pn, 0) != count_ruled.get(pn, 0))
                raise _RuntimeUnsupported(
                    f"parameter(s) {', '.join(bad)} are used more often in the autograd graph "
                    "than by the calls of the layers that own them: they are used outside their "
                    "layer's forward (e.g. F.linear(x, self.fc.weight)), which the per-layer "
                    "rules cannot see")
            # what the per-layer recomputation reads (before it: it runs user code again)
            _refuse_rewritten_inputs(modular)
            if modular and gens is not None:  # (the forward's code may have set the generators)
                gens.reseed()
            lookups = {}
            for c in modular:  # per-example gradients of the per-layer modules' own parameters
                if isinstance(c.fast, EmbeddingLookup) and c.group == 1:
                    lookups[id(c)] = lookup_call(c)  # (the Embedding rule: nothing formed)
                    if stepped_names is not None:
                        stepped_names[c.owner.name] = "embedding_lookup"
                else:
                    c.kept = _kept(c, batch)
                if _time_step(c) and stepped_names is not None:
                    stepped_names[c.owner.name] = "time_step"
                for pn in c.owner.pnames:
                    count[pn] = count.get(pn, 0) + 1
            if lookups:
                live = [lookups.get(id(c), c) for c in live]
        except PerLayerNotProved as exc:  # (not a vmap fallback: see PerLayerNotProved)
            raise _NotTheProvedProgram(str(exc)) from None
        except PerLayerUnsupported as exc:
            raise _RuntimeUnsupported(str(exc)) from None
        finally:
            # no references to the graph or the arguments left behind once the reads are done:
            # dropped from the calls now, held until then (releasing them can run user code, a
            # finalizer on a module's output: twenty-third hostile review, a BatchNorm's
            # statistics rewritten before the rules read them, LOO 3.20 C)
            for c in calls:
                if c.outs is not None:
                    late.append((c.outs, c.bs, c.args, c.fast, c.oedges, c.call))
                    c.outs, c.bs, c.args, c.fast, c.oedges, c.call = [], [], None, None, [], None
        # every tensor of the calls the rules may drop while they read (a rule's prepare replaces
        # c.a with its padded copy) is held until the reads are done: releasing the last
        # reference to a tensor can run user code (a weakref.finalize attached in the forward)
        # AFTER the check below (twenty-second hostile review: a finalizer on a Conv's input
        # rolled the next Linear's input over the batch once prepare dropped it, LOO 2.00 C)
        held = [(c.a, c.edge, c.b) for c in live]
        _refuse_rewritten_inputs(live)
        try:
            with _cm.no_grad():
                loss = float(total if real == batch else losses[:real].sum())
                with exact_float32():  # (engine arithmetic only: the bound stays tight)
                    got = self._reduce(live, count, params, group_of, n_groups, batch,
                                       weight_fn, loss, real)
                if compiled is not None:  # a graph's first step: the constants it read, now
                    while len(compiled.frozen) < len(compiled.pending):
                        compiled.frozen.append(compiled.pending[len(compiled.frozen)].constants())
                return got
        finally:
            # (released by the next chunk once its watch is armed, or after the last chunk):
            # with the losses and the graph (its saved tensors), the calls and the chunk's
            # batch: dropped when this method returned, a finalizer the loss attached to the
            # tensor it returned ran past every check (a weight written through .data with the
            # chunk's labels, unnoised, accepted under ghost and compiled; hundred-and-twenty-
            # seventh hostile review, with the saved tensors the backward let go)
            if carry is not None:
                carry.append((held, late, calls, losses, total, xs, ys))
            del held, late

    def _chunk_size(self) -> int:
        """The most examples a chunk holds: ``max_physical_batch``, else :data:`_PUBLIC_ROWS`
        (public either way: the norms' rounding factor is taken for that many rows)."""
        return self.max_physical_batch or _PUBLIC_ROWS

    def _reduce(
        self,
        live: list[_Call],
        count: dict[str, int],
        params: dict[str, Tensor],
        group_of: dict[str, int],
        n_groups: int,
        batch: int,
        weight_fn: WeightFn,
        loss: float,
        real: int,
    ) -> tuple[dict[str, Tensor], Tensor, Tensor, float]:
        """Norms, weights and the weighted sum of one chunk from the captured ``a`` and ``b``;
        ``real < batch``: a chunk padded with copies of its first example (rows ``real:``,
        :func:`dpclip.engine.batch.padded_rows`), which the strategy never sees and whose weights
        are 0; ``loss``: the sum of the real examples' losses."""
        flushed: dict[tuple, tuple[Tensor, Tensor]] = {}
        for c in live:
            if c.rule.kind != "module":  # (float16 / bfloat16 in float32: _common.HALF)
                _widen(c)
            c.rule.prepare(c)
            if c.rule.kind in ("matmul", "embedding"):
                _flush_tiny(c, flushed)
        self._choose(live, batch)
        first = next(iter(params.values()))
        dtype = first.dtype
        # float16 norms and weights in float32: a norm above 256 overflowed float16's squares,
        # and a weight below 6e-5 is a float16 subnormal, rounded by up to half its value
        # (twenty-ninth hostile review, 1.81 C at C = 1.3e-7); the sums in float32 too, cast by
        # dp_step after the noise (_common.HALF). Nothing is computed in a half dtype here: the
        # rules' a and b are widened (_widen), the per-layer path's kept gradients are summed and
        # their norms taken in float32 (ghost_rules._kept_sum, _sq)
        ndt = sum_dtype(dtype)
        # every dtype a norm or a sum is computed in sets the rounding and underflow terms: each
        # trainable parameter's (a float32 parameter on the per-layer path of a float64 model had
        # its kept gradients' squares underflow in float32 while the floor was float64's: the norm
        # ~1e-153, the example summed unclipped, LOO 1.2e6 C at C = 1e-30, forty-ninth hostile
        # review) and each call's a and b
        dtypes = {ndt} | {sum_dtype(p.dtype) for p in params.values()}
        for c in live:
            for t in (c.a, c.b):
                if isinstance(t, Tensor) and t.is_floating_point():
                    dtypes.add(sum_dtype(t.dtype))
        # (every rounding factor for the chunk's PUBLIC row count, never the realised one: below)
        rows = padded_rows(self._chunk_size())
        assert batch <= rows
        rnd = _Rounding(tuple(dtypes), first.device, rows)
        acc = _GroupNorms(n_groups, rnd)
        acc.add_calls(live, count, group_of, params)
        # (tied parameters' exact bound too: its factor took the padded realised rows, and a
        # tied pair built to cancel turned 32 ulps into 1 % of every norm: 3.8 C under ghost,
        # auto, compiled and make_private, hundred-and-twenty-first hostile review)
        acc.add_formed_and_tied(group_of, params, rows, len(live), n_groups)
        sq = acc.squares(batch, ndt, first.device)
        flat = n_groups == 1
        # the norms used for the weights are upper bounds of the norms of the vectors actually
        # summed, rounding included (module docstring, "Rounding"): the relative factor covers the
        # norms' own reductions (k_rel), the weighted reduction over the batch (its products
        # rounded: u_p), the sum of the book-keeping blocks (_BK_BLOCK: at most one per example),
        # the addition of the directly formed gradients (_FORM_RATIO: one per layer),
        # the sums over layers and groups, the square root and the strategy's few operations on
        # the norm (32)
        # (for the chunk's PUBLIC row count, never the realised one: with the padded batch in
        # it, every example's norm and weight moved when the batch crossed a multiple of 32
        # rows; the quantile count flipped every bit at a threshold, 513 times its sensitivity,
        # and the other examples' weights moved the release by 1.13 C at B = 65,536:
        # hundred-and-twentieth hostile review)
        rho = _rho(rnd, rows, acc.k_rel, len(live), n_groups)
        norms = sq.sqrt() * (1 + rho)
        # underflow, which no relative bound covers (module docstring, "Underflow"): an absolute
        # term from public sizes, then one ulp up (the addition itself rounds)
        floor = _underflow_floor(params, len(live), dtypes)
        norms = torch.nextafter(norms + floor, torch.full_like(norms, math.inf))
        # a sum of non-negative terms is finite iff every term is (or it overflowed: then the
        # exact per-example test below finds every example finite)
        all_finite = math.isfinite(float(sq.sum()))
        finite = None
        if not all_finite:
            finite = torch.isfinite(sq) if flat else torch.isfinite(sq).all(1)
            all_finite = bool(finite.all())
            if not all_finite:
                norms = torch.where(finite if flat else finite[:, None], norms, math.inf)
        if real < batch:
            norms = norms[:real]
        weights = apply_weight_fn(weight_fn, norms, self.name)
        # (the book-keeping products (w b) a underflowing lose an absolute amount whatever w;
        # w b itself must be normal: weights below tiny / flush are 0, _underflow_margin)
        weights = underflow_margin(weights, norms, *_underflow_margin(params, dtypes))
        summed = weights
        if real < batch:  # the copies' weights: exactly 0 (their gradients are the first
            # example's: finite, or masked below with it)
            summed = torch.cat([weights, weights.new_zeros((batch - real, *weights.shape[1:]))])
        wts = _Weights(summed if summed.dtype == ndt else summed.to(ndt), flat)
        if finite is not None and not all_finite:
            acc.mask(live, finite)
        sums = _weighted_sums(live, count, params, group_of, acc, wts)
        out = {}
        for pn, p in params.items():
            g = sums.get(pn)
            sdt = sum_dtype(p.dtype)
            if g is not None and g.dtype == torch.float64:  # (kept in float64 to the step's
                sdt = torch.float64  # end: the chunks' sums are added in float64, cast once)
            if g is None:
                g = torch.zeros_like(p, dtype=sdt, memory_format=torch.contiguous_format)
            elif g.shape != p.shape or g.dtype != sdt or not g.is_contiguous():
                g = g.reshape(p.shape).to(sdt).contiguous()
            out[pn] = g
        return out, norms, weights, loss

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



class _GroupNorms:
    """One chunk's squared per-example norms, summed per group, as the calls are read.

    ``k_rel`` is the longest reduction behind a relative bound (see ``_Rule.rel_len``). A
    parameter used by several calls (tied weights) has its per-example gradient formed for every
    use and summed first (``multi``), exact, when its numel is at most ``_TIED_FORM_MAX_NUMEL``;
    else each use's norm bound is taken by its rule (``tied``: the sum of the bounds, an upper
    bound of the norm of the sum by the triangle inequality), replaced by the exact norm of the sum
    (the uses' cross terms, :mod:`dpclip.engine.tied`) where that is smaller.
    """

    def __init__(self, n_groups: int, rnd: _Rounding) -> None:
        self.acc: list[Tensor | None] = [None] * n_groups
        self.rnd = rnd
        self.k_rel = 0
        self.multi: dict[str, Tensor] = {}
        self.tied: dict[str, Tensor] = {}
        self.tied_uses: dict[str, list[tuple[_Call, str]]] = {}
        #: per use: its norm bound and the relative factor that bound still needs
        self.tied_bounds: dict[str, list[tuple[Tensor, float]]] = {}

    def add(self, g: int, s: Tensor) -> None:
        self.acc[g] = s if self.acc[g] is None else self.acc[g] + s

    def parts(self, c: _Call, roles: Sequence[str]) -> dict[str, Tensor]:
        """The rule's squared norms of ``roles``, the weight's by its rounding bound if it has one."""
        parts = c.rule.norms(c, roles)
        rel = roles
        if "weight" in parts:
            bound = c.rule.bound_sq(c, parts["weight"], self.rnd)
            if bound is not None:
                parts["weight"] = bound
                rel = [r for r in roles if r != "weight"]
        self.k_rel = max(self.k_rel, c.rule.rel_len(c, rel))
        return parts

    def add_calls(self, calls: list[_Call], count: dict[str, int], group_of: dict[str, int],
                  params: dict[str, Tensor]) -> None:
        """:meth:`add_call` for every call; the Linear calls on positions whose shapes are equal
        (ghost_rules.linear_ghost_key) are read together (ghost_rules.linear_ghost_parts: the
        same norms and bounds, the elementwise operations made once for the group)."""
        together: dict[tuple, list[_Call]] = {}
        for c in calls:
            key = linear_ghost_key(c, all(count[pn] == 1 for pn in c.owner.pnames))
            if key is None:
                self.add_call(c, count, group_of, params)
            else:
                together.setdefault(key, []).append(c)
        for group in together.values():
            if len(group) == 1:
                self.add_call(group[0], count, group_of, params)
                continue
            w, bias = linear_ghost_parts(group, self.rnd)
            roles = group[0].owner.roles
            rel = [r for r in roles if r != "weight"]
            self.k_rel = max(self.k_rel, group[0].rule.rel_len(group[0], rel))
            for j, r in enumerate(roles):
                part = w if r == "weight" else bias
                gs = [group_of[c.owner.pnames[j]] for c in group]
                if all(g == gs[0] for g in gs):  # (one group: the calls' parts summed at once)
                    self.add(gs[0], part.sum(0))
                else:
                    for i, g in enumerate(gs):
                        self.add(g, part[i])

    def add_call(self, c: _Call, count: dict[str, int], group_of: dict[str, int],
                 params: dict[str, Tensor]) -> None:
        o = c.owner
        gs = [group_of[pn] for pn in o.pnames]
        single = [count[pn] == 1 for pn in o.pnames]
        if all(single):
            if len(set(gs)) == 1:
                s = c.rule.fused_norm(c, o.roles)
                if s is not None:
                    self.add(gs[0], s)
                    self.k_rel = max(self.k_rel, c.rule.rel_len(c, o.roles))
                    return
            parts = self.parts(c, o.roles)
            for r, g in zip(o.roles, gs):
                self.add(g, parts[r])
            return
        roles = [r for r, one in zip(o.roles, single) if one]
        if roles:
            parts = self.parts(c, roles)
            for r in roles:
                self.add(gs[o.roles.index(r)], parts[r])
        for r, pn, one in zip(o.roles, o.pnames, single):
            if not one:
                self._add_use(c, r, pn, params)

    def _add_use(self, c: _Call, r: str, pn: str, params: dict[str, Tensor]) -> None:
        """One use of a tied parameter: formed, or its norm bound (chosen by numel, never by the
        batch size)."""
        if params[pn].numel() > _TIED_FORM_MAX_NUMEL:
            # parts() for one role, keeping whether the bound is relative
            sq_u = c.rule.norms(c, [r])[r]
            b_sq = c.rule.bound_sq(c, sq_u, self.rnd) if r == "weight" else None
            rel_u = c.rule.rel_len(c, [r] if b_sq is None else [])
            self.k_rel = max(self.k_rel, rel_u)
            n_u = (sq_u if b_sq is None else b_sq).clamp(min=0).sqrt()
            self.tied[pn] = n_u if pn not in self.tied else self.tied[pn] + n_u
            self.tied_uses.setdefault(pn, []).append((c, r))
            self.tied_bounds.setdefault(pn, []).append(
                (n_u, self.rnd.gam(rel_u) if b_sq is None else 0.0))
            return
        g = c.rule.per_example(c, r)
        self.multi[pn] = g if pn not in self.multi else self.multi[pn] + g

    def add_formed_and_tied(self, group_of: dict[str, int], params: dict[str, Tensor],
                            batch: int, n_calls: int, n_groups: int) -> None:
        for pn, g in self.multi.items():
            self.add(group_of[pn], _sq(g))
            self.k_rel = max(self.k_rel, g[0].numel() + 4)
        if self.tied:  # the exact norm of the sum of the uses (cross terms), where it is smaller
            rho_t = _rho(self.rnd, batch, self.k_rel, n_calls, n_groups)
            for pn in self.tied:
                exact = _tied_exact(self.tied_uses[pn], self.tied_bounds[pn], params[pn],
                                    self.rnd, rho_t)
                if exact is not None:
                    self.tied[pn] = torch.minimum(self.tied[pn], exact.to(self.tied[pn].dtype))
        for pn, n_sum in self.tied.items():
            self.add(group_of[pn], n_sum.square())

    def squares(self, batch: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``(B,)`` (one group) or ``(B, G)``; a group with no call is zero."""
        zero = None
        for g in range(len(self.acc)):
            if self.acc[g] is None:
                if zero is None:
                    zero = torch.zeros(batch, dtype=dtype, device=device)
                self.acc[g] = zero
        sq = self.acc[0] if len(self.acc) == 1 else torch.stack(self.acc, 1)  # type: ignore[arg-type]
        return sq if sq.dtype == dtype else sq.to(dtype)

    def mask(self, live: list[_Call], finite: Tensor) -> None:
        """Drop the rows of non-finite examples (weight 0) from what is summed."""
        for c in live:
            c.rule.mask(c, finite)
            for r, g in c.kept.items():
                c.kept[r] = _rows(finite, g)
        for pn, g in self.multi.items():
            self.multi[pn] = _rows(finite, g)


def _weighted_sums(live: list[_Call], count: dict[str, int], params: dict[str, Tensor],
                   group_of: dict[str, int], acc: _GroupNorms, wts: _Weights) -> dict[str, Tensor]:
    """The weighted sum of every parameter's per-example gradients, as each rule forms it."""
    sums: dict[str, Tensor] = {}
    by_dtype = {wts.weights.dtype: wts}

    def of(c: _Call) -> _Weights:  # (half layers' weights in float32: _widen, _common.HALF)
        dt = c.b.dtype if isinstance(c.b, Tensor) else wts.weights.dtype
        if dt in HALF:  # (half products in float32: ghost_rules._kept_sum)
            dt = torch.float32
        got = by_dtype.get(dt)
        if got is None:
            got = by_dtype[dt] = _Weights(wts.weights.to(dt), wts.flat)
        if dt == torch.float32:  # (the weights as float32 computed them, exact in float64)
            got64 = by_dtype.get("64")
            if got64 is None:
                got64 = by_dtype["64"] = _Weights(got.weights.double(), got.flat)
            return got64
        return got

    def rule_sums(c: _Call, todo: dict[str, int]) -> dict[str, Tensor]:
        """``c.rule.weighted`` with the call's float32 (or narrower) ``a`` and ``b`` in float64
        for the products over the examples (float32 products exact there, their sum rounding at
        float64's unit), given back after: a float32 product over the examples of a chunk sums
        them one after another in MKL, and a designed batch steered its rounding by one
        example's presence (1.22 C at one chunk of 4096 examples, 63.4 C at 65,536, through
        make_private too; hundred-and-forty-first hostile review)."""
        w = of(c)
        a, b = c.a, c.b
        if w.weights.dtype == torch.float64:
            c.a, c.b = widen64(a), widen64(b)
        try:
            return c.rule.weighted(c, todo, w)
        finally:
            c.a, c.b = a, b

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
            got = rule_sums(c, todo)
            for r, pn in zip(o.roles, o.pnames):
                if r in got:
                    sums[pn] = got[r]
    for pn, g in acc.multi.items():
        sums[pn] = _kept_sum(g, wts.col(group_of[pn]))
    for pn, uses_ in acc.tied_uses.items():  # each use's weighted sum, as its rule forms it
        grp = group_of[pn]
        for c, r in uses_:
            kept = c.kept.get(r)
            got = _kept_sum(kept, wts.col(grp)) if kept is not None else \
                rule_sums(c, {r: grp})[r]
            got = got.reshape(params[pn].shape)
            sums[pn] = got if pn not in sums else sums[pn] + got
    return sums

#: the flush threshold of :func:`_flush_tiny` per dtype: products of two flushed values are normal
#: numbers with a margin (float32 / bfloat16: at least 2^-80, 2^46 times the smallest normal;
#: float64: 2^-600)
_SCALAR_KERNELS = [torch.backends.cpu.get_cpu_capability() == "DEFAULT"]
#: entries per block of :func:`_shrink`'s numpy pass (256 KiB of float32)
_SHRINK_BLOCK = 1 << 16
#: torch's C hardshrink, bound at import (F.hardshrink's Python looks up names at run time)
_HARDSHRINK = torch.hardshrink
_FLUSH = {torch.float32: 2.0 ** -40, torch.bfloat16: 2.0 ** -40, torch.float64: 2.0 ** -300}
#: positions per example that the absolute term of the book-keeping sums allows for
_MAX_POSITIONS = 2 ** 24
#: the examples of a chunk when ``max_physical_batch`` is None (a public size: the norms'
#: rounding factor is taken for its padded rows, whatever the realised batch)
_PUBLIC_ROWS = 4096


def _widen(c: _Call) -> None:
    """A ruled layer's float16 / bfloat16 ``a`` and ``b`` in float32 (exact), before its rule
    reads them: its norms, products and sums are then computed in float32 (_common.HALF)."""
    for name in ("a", "b"):
        t = getattr(c, name)
        if isinstance(t, Tensor) and t.dtype in HALF:
            setattr(c, name, t.float())


def _shrink(t: Tensor, thr: float, out: Tensor | None = None) -> Tensor:
    """``hardshrink(t, thr)``: entries of magnitude at most ``thr`` set to zero (NaN kept).
    ``out``: ``t`` itself (in place). Under torch's portable CPU kernels
    (``ATEN_CPU_CAPABILITY=default``, :func:`dpclip.blas_mode.kernels`) torch's hardshrink is ~40x
    slower than a mask ``t * (|t| > thr)``, and that mask in torch ~10x slower than in numpy
    (vectorised, branch-free: a masked store or ``where`` is as slow as torch on the mostly-zero
    gradients below a max-pool; each entry alone, so no rounding to depend on the batch), which
    is used there for float32 and float64 (the same values; a zero's sign may differ)."""
    if not _SCALAR_KERNELS[0] or t.device.type != "cpu":
        return _HARDSHRINK(t, thr, out=out) if out is not None else \
            _HARDSHRINK(t, thr)
    if t.dtype in (torch.float32, torch.float64) and not t.is_conj() and not t.is_neg():
        x = t.detach().numpy()  # (numpy's ufuncs as bound at import: ghost_rules._NP_MUL)
        if x.size > _SHRINK_BLOCK and x.flags.c_contiguous:
            # block by block through a magnitude and a mask buffer that stay in cache (the
            # whole-tensor temporaries of a transformer's activations were mapped afresh every
            # step, 3x the time); each entry alone, so the same values
            xf = x.reshape(-1)
            dst = xf if out is not None else _NP_EMPTY(xf.shape, dtype=xf.dtype)
            mag = _NP_EMPTY(_SHRINK_BLOCK, dtype=xf.dtype)
            keep = _NP_EMPTY(_SHRINK_BLOCK, dtype=_NP_BOOL)
            for i in range(0, xf.size, _SHRINK_BLOCK):
                xb = xf[i:i + _SHRINK_BLOCK]
                r = xb.size
                _NP_ABS(xb, out=mag[:r])
                _NP_GREATER(mag[:r], thr, out=keep[:r])
                _NP_MUL(xb, keep[:r], out=dst[i:i + r])
            if out is not None:
                torch.autograd.graph.increment_version(out)  # (an in-place write, as torch's)
                return out
            return _from_numpy(dst.reshape(x.shape))
        keep = _NP_GREATER(_NP_ABS(x), thr)
        if out is not None:
            _NP_MUL(x, keep, out=x)
            torch.autograd.graph.increment_version(out)  # (an in-place write, as torch's)
            return out
        return _from_numpy(_NP_MUL(x, keep))
    keep = t.abs() > thr
    if out is not None:
        return out.mul_(keep)
    return t * keep


def _flush_tiny(c: _Call, shared: dict[tuple, tuple[Tensor, Tensor]] | None = None) -> None:
    """Set the entries of a matmul or embedding layer's ``a`` and ``b`` below :data:`_FLUSH` in
    magnitude to zero, for its norms AND its sums (both read ``c.a`` / ``c.b`` from here on: the
    vector summed is the one whose norm bounds it); float16 is widened to float32 first.

    Why (twenty-seventh hostile review): the ghost formulas multiply sums of squares of ``a`` by
    sums of squares of ``b`` (``||a||^2 ||b||^2``, Gram matrices). With ``a`` of order 1e-24 and
    ``b`` of order 1e19, ``||a||^2`` underflowed to exactly 0 in float32 while the gradient
    ``b a^T`` was of order 1e-5: the norm was 0, the weight 1, and the example was summed
    unclipped (LOO 410 C at C = 1e-7; float64 with 1e-170 and 1e150 alike). The rounding bounds
    are relative and assume no underflow. After the flush every product of two entries is at
    least 2^-80 (float32) in magnitude or exactly zero, so nothing underflows in the Gram matrices
    and row norms; the few squares and products that still can (a formed gradient's squared
    entries, ``||a||^2 ||b||^2``) lose at most the smallest normal each, which
    :func:`_underflow_floor` adds. Entries below 2^-40 (1e-12) change the gradient negligibly.

    ``shared``: the flushed inputs of the chunk's earlier calls, by memory (pointer, shape,
    strides, dtype, device): calls reading one tensor (an attention's query, key and value
    projections) get one flushed copy, the same values, which the reduction then reads once
    (ghost_rules.linear_ghost_parts: one Gram matrix per distinct input)."""
    for name in ("a", "b"):
        t = getattr(c, name)
        if isinstance(t, Tensor) and t.is_complex():
            # (a complex activation or output gradient: the norms take |t|^2 as real squares
            # and drop the imaginary parts, and the flush below would skip it: hundred-and-
            # forty-ninth hostile review)
            raise _RuntimeUnsupported(
                f"layer {c.owner.name!r} ran on a complex tensor; the ghost rules bound real "
                "gradients only (use engine 'vmap' or keep the model real)")
        if not isinstance(t, Tensor) or not t.is_floating_point():
            continue
        if t.dtype in HALF:
            t = t.float()
        thr = _FLUSH.get(t.dtype)
        if thr is None:
            raise UnsupportedModelError(f"ghost engine: a layer's tensors are {t.dtype}; "
                                        "supported: float16, bfloat16, float32, float64")
        with _cm.no_grad():
            if name == "b" and t is getattr(c, name) and t.is_contiguous() and t._base is None:
                # (the output gradient is the engine's own: flushed in place, no allocation; a
                # tensor that two calls share is flushed twice, to the same values)
                _shrink(t, thr, out=t)
            elif shared is None or t is not getattr(c, name):
                setattr(c, name, _shrink(t, thr))
            else:  # (a is the layer's input: the caller's data, or held by the forward)
                # (the entry holds ``t``: its memory cannot be handed to another tensor while the
                # key is in use)
                key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
                got = shared.get(key)
                if got is None:
                    got = shared[key] = (t, _shrink(t, thr))
                setattr(c, name, got[1])


def _draws(m: nn.Module) -> bool:
    """Whether a module of a closed program draws random numbers (a dropout in training mode)."""
    return m.training and type(m).__name__ in _RANDOM_MODULES and getattr(m, "p", 0) > 0


#: the known modules that draw (``ghost_forward._POINTWISE_MODULES``)
_RANDOM_MODULES = frozenset({"Dropout", "AlphaDropout"})


def _underflow_margin(params: dict[str, Tensor], dtypes: set) -> tuple[float, float, float]:
    """``(absolute, covered, zero_below)`` of :func:`_common.underflow_margin` for the ghost sums:
    each book-keeping product ``(w b) a`` (and each ``w g`` of a formed gradient) that underflows
    loses at most half the smallest subnormal, at most :data:`_MAX_POSITIONS` per entry of the
    summed vector; :func:`_underflow_floor`'s ``numel _MAX_POSITIONS tiny`` covers that for
    weights of ``eps`` and more. ``w b`` is a normal number when ``w >= tiny / flush`` (the
    flushed ``b`` is 0 or at least the flush threshold): below, the weight is 0 (hundred-and-
    eleventh hostile review: ``w b`` rounded to 2^-149, times ``a = 2^40``: LOO 50 C)."""
    wide = all(d == torch.float64 for d in dtypes)
    dt = torch.float64 if wide else torch.float32
    numel = sum(p.numel() for p in params.values())
    fi = torch.finfo(dt)
    return (numel * _MAX_POSITIONS * smallest_subnormal(dt), fi.eps, fi.tiny / _FLUSH[dt])


def _underflow_floor(params: dict[str, Tensor], n_calls: int, dtypes: set) -> float:
    """The absolute term added to every norm for underflow (:func:`_flush_tiny`): each squared
    entry of a formed gradient, each ``||a||^2 ||b||^2`` product and each per-call sum of squares
    loses at most ``tiny`` (the smallest normal of the widest-ranged dtype computed in; also under
    flush-to-zero), so the squared norm at most ``(numel + 8 calls) tiny``; the book-keeping
    products ``(w b) a`` lose at most ``tiny`` each, at most :data:`_MAX_POSITIONS` per entry of
    the summed vector. Public sizes only: the same for every example."""
    # (float16 and bfloat16 squares are computed in float32: ghost_rules._sq, _flush_tiny)
    wide = all(d == torch.float64 for d in dtypes)
    tiny = torch.finfo(torch.float64 if wide else torch.float32).tiny
    numel = sum(p.numel() for p in params.values())
    return math.sqrt((numel + 8 * n_calls) * tiny) + numel * _MAX_POSITIONS * tiny


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


@dataclass(frozen=True)
class AutoEngine:
    """``engine="auto"``: the ghost engine (modules without a rule on its per-layer path, named in
    ``engine_info["per_layer"]``), or the vmap engine where the ghost engine refuses the model;
    ``EngineResult.engine_info`` records which one ran and why.

    It is :class:`GhostEngine` with ``fallback="vmap"``: the engine is decided once per model, on
    its first call, by the ghost engine on a PUBLIC probe batch (the first batch's structure and
    trailing shapes, two examples, zeros) before the model sees private data. Models that are
    supported by their layer types but fail a run-time check there (a mixing operation, a
    parameter used outside its layer, an in-place change of a hooked layer's input after the
    layer used it, a layer applied without the batch dimension first) run on ``vmap`` from the
    first step, recorded. A private step that the ghost engine refuses after the probe chose it
    stops the run (docs/errors.md entry 106): its forward has run the model on the private
    batch, and a fallback's vmap would read what the model kept there. Options as
    :class:`GhostEngine`, and

    Args:
        compiled: ``True`` (default): where the batch-size proof's graph is proved
            (:class:`CompiledEngine`: the layers it reads, no per-layer module other than a
            broadcast one), the ghost engine runs that graph instead of the model's code from
            the second private step on (``engine_info["program"] == "compiled"``); the first
            private step of each graph runs traced and checked. The program trained is then the
            one captured for the proof's key: a model whose Python state outside the key (a
            global flag, an object attribute) changes what it computes keeps training the captured
            program (call :func:`dpclip.engine.compiled.reset` after such a change). Other models,
            and any step whose checks refuse the graph, run on the traced path. ``False``: the
            traced path on every step (the model's own code runs, checked operation by operation;
            about twice the step time on Hugging Face models, docs/engines.md).
    """

    name: ClassVar[str] = "auto"
    per_example: ClassVar[bool] = True

    max_physical_batch: int | None = None
    norm_mode: str = "mixed"
    compiled: bool = True

    def __post_init__(self) -> None:
        _check_options(self, "AutoEngine")
        if not isinstance(self.compiled, bool):
            raise ValueError(f"AutoEngine: compiled must be True or False, got "
                             f"{self.compiled!r}")

    def compute(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                weight_fn: WeightFn | None, groups: ParamGroups) -> EngineResult:
        kind = _AutoGhost if self.compiled else _AutoTraced
        engine = kind(self.max_physical_batch, self.norm_mode, "vmap")
        return engine.compute(model, loss_fn, inputs, targets, weight_fn, groups)


@dataclass(frozen=True)
class _AutoGhost(GhostEngine):
    """``auto``'s ghost engine: the compiled path where the proof's graph is proved and runs
    (:class:`CompiledEngine`), else the traced path; a model the ghost engine refuses on the probe
    runs on ``vmap``."""

    name: ClassVar[str] = "auto"
    _compiled: ClassVar[bool] = True
    _prefer: ClassVar[bool] = True


@dataclass(frozen=True)
class _AutoTraced(GhostEngine):
    """``AutoEngine(compiled=False)``: the traced path on every step."""

    name: ClassVar[str] = "auto"


@dataclass(frozen=True)
class CompiledEngine(GhostEngine):
    """:class:`GhostEngine` that runs the batch-size proof's graph instead of the model's code
    (:mod:`dpclip.engine.compiled`; ``auto`` takes the same path where the graph is proved and runs
    the other models traced, :class:`AutoEngine`).

    The graph (``torch.export`` of ``loss_fn(model(xs), ys)`` with a symbolic batch size) is
    proved per-example separable once, on public zeros, by construction rather than by values;
    each step then runs it with the model's current parameters, without the per-operation trace,
    program match and memory watch of the traced ghost step. Same arguments, results and privacy
    contract as :class:`GhostEngine`, except ``fallback`` (none: a model it cannot prove raises
    :class:`~dpclip.engine.errors.UnsupportedModelError` naming the reason). Supported layers:
    ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.Conv1d``, ``nn.Conv2d``,
    ``nn.GroupNorm``, ``nn.RMSNorm``, eval-mode BatchNorm and ``transformers`` Conv1D, each called
    through its own forward, tied parameters and repeated calls included (no per-layer path yet).
    The program trained is the one captured for the proof's key: after changing Python state of the
    model that the key does not see, call :func:`dpclip.engine.compiled.reset`."""

    name: ClassVar[str] = "compiled"
    _compiled: ClassVar[bool] = True

    def _refusal_error(self, reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"{self.name} engine: {reason}. The compiled engine runs models whose parameters "
            "all belong to nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv1d, nn.Conv2d, "
            "nn.GroupNorm, nn.RMSNorm, eval-mode BatchNorm or transformers Conv1D layers, each "
            "called through its own forward, with a forward that torch.export can trace and "
            "whose in-place writes touch only tensors it made, seen by no other alias (docs/engines.md, \"The compiled engine\"); use engine 'ghost' or 'auto' "
            "for other models")

    def __post_init__(self) -> None:
        if self.fallback is not None:
            raise ValueError("CompiledEngine: fallback must be None (the compiled engine is "
                             "chosen explicitly; use engine 'auto' for a fallback)")
        super().__post_init__()
