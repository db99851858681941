"""The ghost engine's per-layer path: per-example gradients of ONE module's own parameters.

A module that owns trainable parameters but has no ghost rule (a custom layer, an RMSNorm-like norm
of a model zoo, a container that reads its parameters directly such as ViT's ``cls_token`` and
``position_embeddings``) does not send the whole model to ``vmap``. Its calls are hooked like the
ruled layers'; their output tensors (and so the autograd graph of the module's own forward) are
kept through the ONE backward pass of the ghost engine, which also delivers ``b``, the gradient of
the summed per-example loss with respect to each output. Then the per-example gradient of the
module's parameters is the vector-Jacobian product of example ``i``'s row of ``b`` through the
module's own graph,

    ``g_i = (d out / d theta)^T (b masked to example i)``,

computed for a block of examples at once with ``torch.autograd.grad(..., is_grads_batched=True)``
(a loop over examples if a backward formula cannot be batched). For a parameter read directly
(``cls_token.expand(B, -1, -1)``, ``x + position_embeddings``) this is the gradient flowing into its
broadcast use, summed over the broadcast dimensions of one example. The per-example gradients are
kept and the weighted sum is their weighted reduction, so the norm that sets an example's weight is
the norm of the very vector summed (the rounding of the product ``g_i`` does not matter: whatever is
formed is what is bounded and summed).

Why it is exact and where it is refused (:func:`check_module_windows`):

* the module's outputs must be proved row separable by the separability trace (its operations run
  under the tracer like every other operation of the forward), so ``out_j`` depends on example
  ``j`` and constants only and row ``i`` of the product above is example ``i``'s gradient;
* every use of the module's parameters must lie inside one of its calls: each autograd node has a
  sequence number, and the nodes created during a call lie in the window between the call's forward
  pre-hook and its forward hook. The edges into a parameter's ``AccumulateGrad`` node from nodes in
  those windows that are reachable from the call's live outputs must be ALL its edges in the graph
  (a use outside the module, e.g. ``F.linear(x, block.weight)`` elsewhere, or a tensor derived from
  the parameter kept for later, is refused);
* the product must be the call's LOCAL derivative: no path from a call's outputs may leave the call's
  window and come back to the module's parameters (the module applied to its own output, weight
  sharing across calls in sequence): refused.

A refusal raises :class:`PerLayerUnsupported` (the ghost engine turns it into its run-time refusal,
then ``auto`` falls back to ``vmap`` and says why).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["PerLayerUnsupported", "check_module_windows", "join_layouts", "module_grads",
           "output_tensors", "seq_now"]

#: per-example temporaries of the batched vector-Jacobian product (the masked output gradients,
#: ``k x`` the outputs' size for ``k`` examples at a time) are kept below this many floats
_VJP_MAX_NUMEL = 1 << 24

_SEQ_LEAF = torch.zeros((), requires_grad=True)


class PerLayerUnsupported(Exception):
    """A module on the per-layer path whose per-example gradient cannot be read from its call."""


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
    """The separability layout that stands for several outputs: the first one that is not
    ``(0, 1)`` or constant (``None``), else ``(0, 1)`` if any is, else ``None``."""
    out = None
    for lay in lays:
        if lay is not None and lay != (0, 1):
            return lay
        if lay == (0, 1):
            out = lay
    return out


def _accumulate_var(fn: Any) -> Any:
    return getattr(fn, "variable", None)


def _reaches(roots: Iterable[Any], targets: set[int], memo: dict[Any, bool]) -> bool:
    """Whether any of ``roots`` (autograd nodes) reaches an ``AccumulateGrad`` node of a tensor
    whose id is in ``targets`` (iterative, memoised over calls)."""
    stack = [(r, False) for r in roots if r is not None]
    while stack:
        node, done = stack.pop()
        if node in memo and not done:
            continue
        if done:
            memo[node] = any(memo.get(n, False) for n, _ in node.next_functions if n is not None)
            continue
        var = _accumulate_var(node)
        if var is not None:
            memo[node] = id(var) in targets
            continue
        stack.append((node, True))
        for n, _ in node.next_functions:
            if n is not None and n not in memo:
                stack.append((n, False))
    return any(memo.get(r, False) for r in roots if r is not None)


def check_module_windows(calls: Sequence[Any], uses: dict[str, int],
                         ruled: dict[str, int], by_param: dict[int, str]) -> None:
    """Check that the per-layer calls' vector-Jacobian products give the per-example gradients of
    their modules' parameters (module docstring). ``calls``: the live per-layer calls (``outs``,
    ``bs``, ``window``, ``owner``); ``uses``: edges into each parameter's ``AccumulateGrad`` node in
    the whole graph; ``ruled``: the number of ruled layer calls using each parameter (tied with a
    ruled layer); ``by_param``: canonical names by ``id(param)``. Raises
    :class:`PerLayerUnsupported`."""
    counted: dict[str, int] = dict(ruled)
    memo: dict[Any, bool] = {}
    for c in calls:
        name = c.owner.name
        start, end = c.window
        if start is None:
            raise PerLayerUnsupported(
                f"the call of module {name!r} ({type(c.mod).__name__}) was not seen entering "
                "(its forward pre-hook did not run); call it through its module")
        own = {id(getattr(c.mod, r)) for r in c.owner.roles}
        roots = [t.grad_fn for t, b in zip(c.outs, c.bs) if b is not None and t.grad_fn is not None]
        seen: set[Any] = set()
        outside: list[Any] = []
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            for n, _ in node.next_functions:
                if n is None:
                    continue
                var = _accumulate_var(n)
                if var is not None:
                    if id(var) in own:
                        pn = by_param.get(id(var))
                        if pn is not None:
                            counted[pn] = counted.get(pn, 0) + 1
                    continue
                if start < n._sequence_nr() < end:
                    stack.append(n)
                else:
                    outside.append(n)
        if outside and _reaches(outside, own, memo):
            raise PerLayerUnsupported(
                f"module {name!r} ({type(c.mod).__name__}, per-layer path) receives an input that "
                "depends on its own parameters (e.g. the module applied to its own output, or "
                "weights shared by calls in sequence): its per-example gradient cannot be read "
                "from one call; use engine 'vmap'")
    names = {by_param[id(getattr(c.mod, r))] for c in calls for r in c.owner.roles
             if id(getattr(c.mod, r)) in by_param}
    bad = sorted(pn for pn in names if counted.get(pn, 0) != uses.get(pn, 0))
    if bad:
        raise PerLayerUnsupported(
            f"parameter(s) {', '.join(bad)} of per-layer module(s) are used outside the calls of "
            "the modules that own them (e.g. read by another module, or a tensor derived from "
            "them kept for later): their per-example gradient cannot be read from the module's "
            "calls; use the parameter only inside its module's forward, or engine 'vmap'")


def module_grads(c: Any, batch: int) -> dict[str, Tensor]:
    """Per-example gradients ``(B, *param.shape)`` of the module's own trainable parameters from
    one call (``c.outs``, their output gradients ``c.bs``), by role. The autograd graph of the call
    must still be alive (the engine's backward retained it)."""
    roles = c.owner.roles
    params = [getattr(c.mod, r) for r in roles]
    pairs = [(t, b) for t, b in zip(c.outs, c.bs) if b is not None]
    outs = [t for t, _ in pairs]
    bs = [b for _, b in pairs]
    per_ex = sum(b.numel() for b in bs)
    k = max(1, min(batch, _VJP_MAX_NUMEL // max(per_ex, 1)))
    parts: list[list[Tensor]] = [[] for _ in params]
    try:
        for start in range(0, batch, k):
            stop = min(start + k, batch)
            n = stop - start
            rows = torch.arange(n)
            gos = []
            for b in bs:
                go = b.new_zeros((n, *b.shape))
                go[rows, rows + start] = b[start:stop]
                gos.append(go)
            got = torch.autograd.grad(outs, params, gos, retain_graph=True, allow_unused=True,
                                      is_grads_batched=True)
            for j, (g, p) in enumerate(zip(got, params)):
                parts[j].append(g if g is not None else p.new_zeros((n, *p.shape)))
    except RuntimeError:  # a backward formula that cannot be batched: one example at a time
        parts = [[] for _ in params]
        for i in range(batch):
            gos = []
            for b in bs:
                go = torch.zeros_like(b)
                go[i] = b[i]
                gos.append(go)
            got = torch.autograd.grad(outs, params, gos, retain_graph=True, allow_unused=True)
            for j, (g, p) in enumerate(zip(got, params)):
                parts[j].append((g if g is not None else torch.zeros_like(p)).unsqueeze(0))
    return {r: (ps[0] if len(ps) == 1 else torch.cat(ps)) for r, ps in zip(roles, parts)}
