"""In-place operations on the compiled engine's graph (``dpclip.engine.compiled._out_of_place``):
a write to a tensor the graph made (``h += residual``, as ResNet, Megatron-BERT, T5 and MPNet
write it) runs as its functional twin, equal to the float64 per-example loop; a write that an
alias would see (a view taken before it, or the tensor a view was taken from, read after it), a
write that promotes, and a write to the graph's inputs are left in the graph and refused, as
before. On ``auto`` a refused graph runs on the traced path, which stays sound (leave-one-out at
most C)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, CompiledEngine, ParamGroups
from dpclip.engine import compiled as compiled_mod
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT, clip_weights
from tests.engine.test_compiled_engine import C, _check_against_the_loop, graph_runs
from tests.engine.test_separability_attacks import Net, ce, data, loo_distance


def _residual(m: nn.Module, h: Tensor) -> Tensor:
    r = torch.tanh(h)
    h += r  # (h: fc1's output, a tensor the graph made; fc1 kept its input, not h)
    return h


def _chain(m: nn.Module, h: Tensor) -> Tensor:
    h = h * 1.5
    h += 1.0
    h.mul_(torch.sigmoid(h))  # (reads the written tensor: the twin of the first write)
    h.clamp_(-2.0, 2.0)
    return h


def _fc1_output_written(m: nn.Module, h: Tensor) -> Tensor:
    out = h.clone()
    h.add_(out)  # fc1's output, which its rule reads for nothing (only its input is kept)
    return h * out


def _filled(m: nn.Module, h: Tensor) -> Tensor:
    z = (h * 2).masked_fill_(h > 0.5, 0.25)  # (the written tensor's dtype whatever the value's)
    return z + torch.zeros(h.shape[1], dtype=h.dtype).fill_(0.5) * h


ACCEPTED = {"residual": _residual, "chain": _chain, "output-written": _fc1_output_written,
            "fill-copy": _filled}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_writes_to_the_graphs_own_tensors_run_compiled_and_equal_the_loop(name):
    torch.manual_seed(0)
    model = Net(ACCEPTED[name]).to(DT)
    x, y = data()
    _check_against_the_loop(model, ce, x, y, ParamGroups.flat(model))


def _view_read_after(m: nn.Module, h: Tensor) -> Tensor:
    v = h[:, :3]  # a view taken before the write sees it
    h.add_(1.0)
    return torch.cat([v, h[:, 3:]], 1)


def _base_read_after(m: nn.Module, h: Tensor) -> Tensor:
    h = h * 1.0
    h[:, 0].mul_(3.0)  # a write through a view: the base read afterwards sees it
    return h


def _promoting(m: nn.Module, h: Tensor) -> Tensor:
    h = h.float()
    h += (h.double() * 1e-9)  # float32 += float64: the in-place form casts back, add would not
    return h.double()


def _mixing_write(m: nn.Module, h: Tensor) -> Tensor:
    h = h * 1.0
    h += h.mean(0)  # out of place or not, the examples mix: the analysis refuses it
    return h


def _piece_read_after(m: nn.Module, h: Tensor) -> Tensor:
    h = h * 1.0
    a, b = torch.tensor_split(h, 2, dim=1)  # (a list of views: its alias sets sit on the items)
    a.mul_(3.0)  # the base, read afterwards, sees it (seventy-eighth hostile review)
    return h


def _hsplit_base_written(m: nn.Module, h: Tensor) -> Tensor:
    h = h * 1.0
    a, b = torch.hsplit(h, 2)
    h.add_(1.0)  # the pieces, read afterwards, see it
    return torch.cat([a * 2, b], 1)


REFUSED = {"view-read-after": _view_read_after, "base-read-after": _base_read_after,
           "promoting": _promoting, "mixing": _mixing_write, "piece-read-after": _piece_read_after,
           "hsplit-base-written": _hsplit_base_written}


@pytest.mark.parametrize("name", list(REFUSED))
def test_writes_an_alias_would_see_are_refused(name):
    """Left in the graph (or, for the mixing one, rewritten and refused by the analysis): the
    compiled engine refuses the model."""
    torch.manual_seed(0)
    model = Net(REFUSED[name]).to(DT)
    x, y = data()
    with pytest.raises(UnsupportedModelError, match="mixes" if name == "mixing" else
                       "writes in place"):
        for _ in range(2):
            CompiledEngine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))


@pytest.mark.parametrize("name", ["view-read-after", "base-read-after", "promoting",
                                  "piece-read-after"])
def test_on_auto_refused_writes_run_traced_and_stay_within_c(name):
    torch.manual_seed(0)
    model = Net(REFUSED[name]).to(DT)
    x, y = data()
    eng = AutoEngine()
    with graph_runs() as ran:
        for _ in range(2):
            eng.compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
        assert loo_distance(eng, model, ce, x, y) <= 1 + 1e-9
    assert ran[0] == 0


def _graph(fn, *shapes) -> torch.fx.Graph:
    from torch.export import Dim, export

    class M(nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    xs = tuple(torch.randn(*s, dtype=DT) for s in shapes)
    dyn = tuple({0: Dim("b", min=2)} for _ in shapes)
    ep = export(M(), xs, dynamic_shapes=(dyn,), strict=False)
    gm = torch.fx.GraphModule(ep.graph_module, ep.graph_module.graph.__deepcopy__())
    return gm, xs


def _mutating(graph: torch.fx.Graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]


def test_the_rewrite_keeps_the_programs_values():
    """Unit: the rewritten graph has no write left and computes what the graph with the writes
    computes (a chain of writes, a write read by a later view, two writes to one tensor)."""
    def fn(x, r):
        h = x * 2
        h += r
        v = h.view(h.shape[0], -1).sum(1)  # (a view of the twin, read before the next write)
        h.mul_(0.5)
        return (h * 3).sum(1) + v

    gm, xs = _graph(fn, (4, 3), (4, 3))
    want = gm(*xs)
    compiled_mod._out_of_place(gm.graph)
    gm.recompile()
    assert _mutating(gm.graph) == []
    torch.testing.assert_close(gm(*xs), want, rtol=0, atol=0)
    assert torch.equal(want[0], fn(*(t.clone() for t in xs)))  # (the eager program too)


def test_the_rewrite_refuses_a_view_read_after_the_write():
    def fn(x):
        h = x * 2
        v = h[:, :1]
        h.add_(1.0)
        return (v + h[:, 1:]).sum(1)

    gm, _ = _graph(fn, (4, 3))
    with pytest.raises(compiled_mod.CompiledUnsupported, match="read after the write"):
        compiled_mod._out_of_place(gm.graph)


def test_the_rewrite_sees_an_unsafe_view_as_an_alias():
    """``aten._unsafe_view`` shares its input's memory without saying so in its schema: a write
    to it is seen by its input, read afterwards, so the write stays (and is refused)."""
    def fn(x):
        h = x * 2
        u = torch.ops.aten._unsafe_view(h, [h.shape[0], 3])
        u.add_(1.0)
        return (h + u).sum(1)

    gm, _ = _graph(fn, (4, 3))
    with pytest.raises(compiled_mod.CompiledUnsupported, match="read after the write"):
        compiled_mod._out_of_place(gm.graph)
