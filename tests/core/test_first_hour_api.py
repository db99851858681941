"""The API as a new user meets it (issue 35): make_private's signature and batch size, labels and
arrays checked before the first step, did-you-mean, messages naming Python arguments,
check_model / fix_model."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.private import PrivateTraining, make_private


def _data(n=128, d=6, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, k, generator=g)).argmax(1)
    return x, y


def _model(d=6, k=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, k))


BASE = dict(noise_multiplier=1.0, epochs=1, delta=1e-5, reproducible_noise=True)


def test_make_private_signature_lists_every_parameter():
    """help(make_private) and IDE completion see every parameter (no **kwargs), and every
    parameter of PrivateTraining a user sets is there, documented in the docstring."""
    sig = inspect.signature(make_private)
    assert not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    wanted = set(inspect.signature(PrivateTraining.__init__).parameters) - {"self", "flags"}
    assert wanted <= set(sig.parameters)
    doc = make_private.__doc__ or ""
    for name in wanted - {"model", "optimizer", "data"}:
        assert f"{name}:" in doc, name


def test_batch_size_comes_from_the_dataloader_and_is_said(capsys):
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    dp = make_private(_model(), None, loader, **BASE)
    assert dp.sampler.expected_batch_size == 16
    assert "batch_size = 16 (the DataLoader's" in capsys.readouterr().err
    dp = make_private(_model(), None, loader, batch_size=32, **BASE)
    assert dp.sampler.expected_batch_size == 32
    assert "DataLoader's batch_size 16 is not used" in capsys.readouterr().err


def test_batch_size_missing_is_an_error_not_256():
    x, y = _data()
    with pytest.raises(ValueError, match=r"make_private: batch_size is required \(data is "
                                         r"tuple\): pass batch_size="):
        make_private(_model(), None, (x, y), **BASE)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="uses a batch_sampler"):
        make_private(_model(), None, loader, **BASE)
