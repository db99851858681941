"""The ghost engine's backward without the graph's hooks (issue 31, fourth pass's open holes).

``torch.autograd.grad(total, edges)`` runs every hook attached to a node of the graph. The forward
and loss are user code, and autograd lets Python list none of a node's hooks: a hook dictionary
set through ``torch._C.TensorBase._backward_hooks``, attached with ``grad_fn._register_hook_dict``
and the descriptor cleared again, stays on the node unseen (LOO 2.07 C with a Python hook, 2.25 C
with ``functools.partial(torch.roll, ...)``, 1.26 C with ``functools.partial(next, iter([t]))``
returning a tensor the forward computed from the whole batch: no Python frame, torch function or
ATen operation runs for it in the backward, so no profiler or mode over the backward could see
it). Its registration cannot be seen either: ``_register_hook_dict`` is a C method, and a call
from C (``map``, ``functools.partial``) reaches no profiler.

:func:`hook_free_grad` computes the same gradients without running any hook: it calls each node
of the graph itself (``node(*grads)`` runs the node's formula only; autograd's engine runs the
hooks around it), in a topological order, summing the gradients that reach a node and reducing
each to the shape and dtype its input expects (what the engine's ``validate_outputs`` does). The
walk runs inside a graph task of ``torch.autograd.grad(..., edges)`` (the backward of a root
``Function`` of the engine's own, which then stops the task), so that every node computes only
the gradients that lead to the edges: the parameter-gradient products are skipped as before, and
the operations are the engine's (tests/engine/test_hook_free.py counts them).

The ghost engine walks only where user code ran in the forward or loss (a traced step, a chunk
of one); a program of known modules and a known loss, where no user code runs between the
creation of its nodes and the backward, keeps ``torch.autograd.grad``.

Costs: the graph is walked in Python (a few microseconds per node;
benchmarks/results/hook_free_cost_cpu.md). Memory: autograd's engine frees a node's saved tensors
once the node has run; the walk does not. Freeing a tensor the forward made can run user code (a
``weakref.finalize`` or ``__del__`` attached to it or to its storage), and inside the backward
that code ran after the loss had returned, past every check of the forward: it rewrote a tensor
an earlier node had saved (its version counter set back) so that every row's gradient carried
example 0 (LOO 11.0 C under ghost, auto and compiled), or wrote a constant of the compiled graph
before its copy was taken (8.3 C on every later step; hundred-and-twenty-seventh hostile review).
The saved tensors stay with the graph, which the chunk hands to the next chunk's armed watch or to
the last chunk's release check (``ghost._release_last``): the backward's peak memory is then the
forward's saved tensors plus the output gradients (benchmarks/results/saved_release_memory_cpu.md).
"""

from __future__ import annotations

import heapq
from typing import Any, Sequence

import torch
from torch import Tensor

from dpclip._ident import ident
from dpclip.engine import _cm

__all__ = ["hook_free_grad"]


class _Stop(Exception):
    """Raised by the root's backward after the walk: the graph task stops there, so that
    autograd's engine runs no node (and no hook) of the user's graph."""


def hook_free_grad(total: Tensor, edges: Sequence[Any]) -> list[Tensor | None]:
    """The gradients of the scalar ``total`` with respect to ``edges``
    (``torch.autograd.graph.GradientEdge``), as ``torch.autograd.grad(total, edges,
    allow_unused=True)`` returns them, computed without running any hook of the graph (module
    docstring). An edge that ``total`` does not reach gets None."""
    if total.grad_fn is None or not edges:
        return [None] * len(edges)
    box: dict[str, Any] = {"root": total.grad_fn, "edges": list(edges)}
    out = _Root.apply(total, box)
    try:
        torch.autograd.grad(out, list(edges), allow_unused=True)
    except _Stop:
        pass
    got = box.get("got")
    if got is None:  # (the root's backward did not run: nothing reaches the edges)
        return [None] * len(edges)
    return [got.get(ident(e.node), {}).get(e.output_nr) for e in edges]


class _Root(torch.autograd.Function):
    """``total`` as the root of the graph task; its backward is the walk (:func:`_walk`)."""

    @staticmethod
    def forward(ctx: Any, total: Tensor, box: dict) -> Tensor:  # type: ignore[override]
        ctx.box = box
        return total.view_as(total)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        box = ctx.box
        targets = {ident(e.node): e.node for e in box["edges"]}
        with _cm.no_grad():
            box["got"] = _walk(box["root"], g, targets)
        raise _Stop


def _graph(root: Any) -> tuple[list[Any], dict[int, tuple[tuple[Any, int], ...]]]:
    """The nodes reachable from ``root`` in post-order (every node after all it leads to) and
    each node's ``next_functions`` (``(next node or None, input number)`` per output)."""
    children: dict[int, tuple[tuple[Any, int], ...]] = {}
    post: list[Any] = []
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        n, done = stack.pop()
        k = ident(n)
        if done:
            post.append(n)
            continue
        if k in children:
            continue
        ch = n.next_functions
        children[k] = ch
        stack.append((n, True))
        stack.extend((c, False) for c, _ in ch if c is not None and ident(c) not in children)
    return post, children


def _walk(root: Any, root_grad: Tensor, targets: dict[int, Any]) -> dict[int, dict[int, Tensor]]:
    """``{ident(target node): {input number: gradient}}``: the graph below ``root`` evaluated node by
    node, as autograd's engine does, without the hooks."""
    post, children = _graph(root)
    needed = {k for k in targets if k in children}  # the nodes on a path to a target
    for n in post:  # (post-order: a node's children are decided before it)
        if any(ident(c) in needed for c, _ in children[ident(n)]):
            needed.add(ident(n))
    called = {k for k in needed if any(ident(c) in needed for c, _ in children[k])}
    deps: dict[int, int] = {}
    for k in called:
        for c, _ in children[k]:
            if ident(c) in needed:
                deps[ident(c)] = deps.get(ident(c), 0) + 1
    buf: dict[int, dict[int, Tensor]] = {ident(root): {0: root_grad}}
    got: dict[int, dict[int, Tensor]] = {}
    # autograd's order: the ready node made last in the forward first (its sequence number), so
    # that the gradients reaching a node are summed in the engine's order
    ready = [(-root._sequence_nr(), 0, root)]
    pushed = 1
    while ready:
        n = heapq.heappop(ready)[2]
        k = ident(n)
        ins = buf.pop(k, {})
        if k in targets:
            got[k] = ins
        if k not in called:
            continue
        args = [ins.get(i) for i in range(len(n._input_metadata))]
        outs: Any = (None,) * len(children[k])
        if any(a is not None for a in args):
            outs = n(*args)  # (its saved tensors stay with the graph: module docstring)
            if not isinstance(outs, (tuple, list)):
                outs = (outs,)
        for (c, nr), g in zip(children[k], outs):
            if c is None or ident(c) not in needed:
                continue
            if g is not None:
                _add(buf.setdefault(ident(c), {}), nr, _fit(g, c._input_metadata[nr]))
            deps[ident(c)] -= 1
            if not deps[ident(c)]:
                heapq.heappush(ready, (-c._sequence_nr(), pushed, c))
                pushed += 1
    return got


def _fit(g: Tensor, meta: Any) -> Tensor:
    """``g`` as the node's input expects it (autograd's ``validate_outputs``): summed to its
    shape (a broadcast in the forward), in its dtype and on its device."""
    shape = tuple(meta.shape)
    if tuple(g.shape) != shape:
        g = g.sum_to_size(shape)
    if g.dtype != meta.dtype:
        g = torch.real(g).to(meta.dtype) if g.is_complex() and not meta.dtype.is_complex \
            else g.to(meta.dtype)
    if g.device != meta.device:
        g = g.to(meta.device)
    return g


def _add(into: dict[int, Tensor], nr: int, g: Tensor) -> None:
    old = into.get(nr)
    into[nr] = g if old is None else old + g
