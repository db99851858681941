"""Ninety-seventh hostile review (a fresh attack on the proof: Hugging Face models, losses, the
per-layer path, ties and structure changes between steps) found no way above C, and two faults
that are not privacy: vmap missing the gradient through a tensor kept with its autograd graph,
and a tie made or broken between steps stopping the run instead of proving it again."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError

DT = torch.float64


def _ce(o: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(o, y, reduction="none")


def _wf(norms: Tensor) -> Tensor:
    return torch.clamp(1.0 / norms, max=1.0)


def _true_norms(m: nn.Module, x: Tensor, y: Tensor) -> list[float]:
    ps = [p for p in m.parameters() if p.requires_grad]
    return [math.sqrt(sum(float((g ** 2).sum()) for g in torch.autograd.grad(
        _ce(m(x[i:i + 1]), y[i:i + 1]).sum(), ps))) for i in range(len(x))]


class _KeptView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3).to(DT)
        self.view = self.fc.bias.expand(8, 3)  # a view kept with its graph to the parameter

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) + 3 * self.view[: x.shape[0]]


@pytest.mark.parametrize("engine", ["vmap", "auto"])
def test_a_tensor_kept_with_its_graph_is_refused_by_vmap(engine):
    """Before: vmap ran on its own copies of the parameters and missed the path through the kept
    view: the true per-example norm was 1.15x the engine's (a silently wrong gradient)."""
    torch.manual_seed(0)
    m = _KeptView()
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 3, (4,))
    with pytest.raises(UnsupportedModelError, match="keeps attribute 'view'.*autograd graph"):
        get_engine(engine).compute(m, _ce, x, y, _wf, ParamGroups.flat(m))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 6).to(DT)
        self.fc = nn.Linear(6, 6).to(DT)
        self.head = nn.Linear(6, 7).to(DT)
        self.head.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc(self.emb(x))))


@pytest.mark.parametrize("engine", ["ghost", "auto"])
@pytest.mark.parametrize("change", ["break", "make"])
def test_a_tie_changed_between_steps_is_proved_again(engine, change):
    """Before: 'the step does not run the program that the batch-size proof traced'."""
    torch.manual_seed(0)
    m = _Tied()
    if change == "make":
        m.head.weight = nn.Parameter(m.emb.weight.detach().clone())
    eng = get_engine(engine)
    x, y = torch.randint(0, 7, (6,)), torch.randint(0, 7, (6,))
    for _ in range(2):
        eng.compute(m, _ce, x, y, _wf, ParamGroups.flat(m))
    if change == "break":
        m.head.weight = nn.Parameter(m.emb.weight.detach().clone())
    else:
        m.head.weight = m.emb.weight
    got = eng.compute(m, _ce, x, y, _wf, ParamGroups.flat(m))
    torch.testing.assert_close(got.norms.double(), torch.tensor(_true_norms(m, x, y), dtype=DT),
                               rtol=1e-9, atol=0)
