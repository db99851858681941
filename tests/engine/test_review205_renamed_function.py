"""Hostile review 205: one of torch's own Python functions put under another of torch's names before
dpclip first looked (``torch.tanh = F.log_softmax``, ``F.softmax``, ``F.softmin``) passed as torch's
own by its file alone: nn.Tanh then normalised over the batch (the implicit dimension of a 3-D
input is 0), untraced in a known chain: 3.72 C under ghost, auto and compiled. A Python function
found under a name must now be named so (as a plain name), or be one of torch's own aliases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import library_code
from dpclip.engine.known_losses import cross_entropy_per_example
from tests.engine.test_review194_compiled_call_impl import _user_ce, release_loo

B, T, D, K = 16, 3, 4, 4


def _make():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Flatten(), nn.Linear(T * D, K))


def _forget():
    library_code._BY_CLASS.clear()
    library_code._CALL = None


@pytest.mark.parametrize("replacement", ["log_softmax", "softmax", "softmin"])
@pytest.mark.parametrize("loss", [cross_entropy_per_example, _user_ce], ids=["known", "user"])
@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_another_torch_function_under_a_torch_name_is_refused_or_bounded(replacement, loss,
                                                                          engine):
    g = torch.Generator().manual_seed(0)
    x, y = 10 * torch.randn(B, T, D, generator=g), torch.randint(0, K, (B,), generator=g)
    real = torch.tanh
    _forget()
    torch.tanh = getattr(F, replacement)  # (before dpclip's first look)
    try:
        worst = release_loo(engine, _make, x, y, loss)
    finally:
        torch.tanh = real
        _forget()
    assert worst is None or worst <= 1.0 + 1e-6, worst


def test_the_scan_names_torchs_own_aliases():
    assert library_code._named_as("forward", nn.Module.forward)
    assert library_code._named_as("tanh", F.tanh)
    assert not library_code._named_as("tanh", F.log_softmax)
