"""Ninety-eighth hostile review (a fresh attack on the proof and the release: torch's layers,
shapes, make_private loops; no way above C) found one fault outside privacy: the PLD accountant at
``noise_multiplier=1e-3`` asked dp-accounting for a 3.8 GiB array, or ran for over 20 minutes, in
make_private's up-front check."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from dpclip.accounting.accountants import (PLD_MAX_GRID_POINTS, PLDGridTooLarge, compute_epsilon,
                                           pld_grid_points)
from dpclip.events import GaussianEvent, PoissonSampledEvent


def test_a_tiny_noise_multiplier_is_refused_by_pld_at_once_and_rdp_still_answers():
    ev = PoissonSampledEvent(0.01, GaussianEvent(1e-3))
    t = time.perf_counter()
    with pytest.raises(PLDGridTooLarge, match="use accountant='rdp'"):
        compute_epsilon(ev, 1e-5, "pld")
    assert time.perf_counter() - t < 5.0
    assert compute_epsilon(ev, 1e-5, "rdp").epsilon > 0


def test_the_grid_estimate_admits_every_useful_noise_multiplier():
    for z in (0.05, 0.3, 1.0, 10.0):
        assert pld_grid_points(z, 1e-3) < PLD_MAX_GRID_POINTS
    assert compute_epsilon(PoissonSampledEvent(0.01, GaussianEvent(0.05)), 1e-5, "pld").epsilon > 0


def test_make_private_with_a_tiny_multiplier_says_to_use_rdp():
    from dpclip.training.private import make_private

    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    with pytest.raises(ValueError, match="use accountant='rdp'"):
        make_private(nn.Linear(4, 2), None, (x, y), noise_multiplier=1e-3, steps=3, batch_size=8,
                     delta=1e-5, verbose=False)


def test_calibration_steps_over_the_refused_multipliers(monkeypatch):
    import dpclip.accounting.accountants as acc
    from dpclip.accounting.calibration import calibrate_noise_multiplier

    monkeypatch.setattr(acc, "PLD_MAX_GRID_POINTS", 10 ** 5)  # (the floor near z = 0.35: fast)

    def make(z):
        return PoissonSampledEvent(0.5, GaussianEvent(z))

    z = calibrate_noise_multiplier(100.0, 1e-5, make)  # (z ~ 0.1 would meet it: refused)
    assert pld_grid_points(z, 1e-3) <= 10 ** 5
    assert compute_epsilon(make(z), 1e-5, "pld").epsilon <= 100.0
