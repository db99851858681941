"""Andrew et al.'s quantile-tracking simulation (their Figure 2; algorithms.md M6 / section 3.5).

Each round ``m`` users report an update whose norm is drawn from a log-normal distribution; the
server runs the SAME private aggregation as DP-FedAvg (:class:`DPAggregator` with a
``QuantileClip``: centred count, ``sigma_b = m/20``, geometric update) on one-dimensional "deltas"
equal to those norms, and we watch ``C_t`` approach the target quantile of the distribution.
The paper's settings: ``exp(N(0, 1))``, ``exp(N(0, 0.1))``, ``exp(N(log 10, 1))``; ``eta_C = 0.2``,
``C_0 = 0.1``, ``m = 100``, quantiles ``{0.1, 0.3, 0.5, 0.7, 0.9}``, 200 rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from dpclip.clipping.quantile import QuantileClip
from dpclip.federated.aggregator import DPAggregator, make_user_sampler
from dpclip.randomness import PrivateRandomness

__all__ = ["LOGNORMAL_SETTINGS", "lognormal_quantile", "track_quantile"]

#: the paper's three distributions: (name, mu, sigma) of log-norm ~ N(mu, sigma^2)
LOGNORMAL_SETTINGS: tuple[tuple[str, float, float], ...] = (
    ("exp(N(0,1))", 0.0, 1.0),
    ("exp(N(0,0.1))", 0.0, 0.1),
    ("exp(N(log 10,1))", math.log(10.0), 1.0),
)


def lognormal_quantile(mu: float, sigma: float, gamma: float) -> float:
    """The ``gamma`` quantile of ``exp(N(mu, sigma^2))``."""
    return math.exp(mu + sigma * NormalDist().inv_cdf(gamma))


@dataclass(frozen=True)
class TrackResult:
    clip_norms: list[float]  #: C_t for t = 0..rounds (public)
    target: float  #: the true quantile


def track_quantile(mu: float, sigma: float, gamma: float, *, rounds: int = 200,
                   clients: int = 100, initial_clip_norm: float = 0.1, clip_lr: float = 0.2,
                   count_noise_std: float | None = None, seed: int = 0,
                   noise_multiplier: float = 0.0) -> TrackResult:
    """Track the ``gamma`` quantile of ``exp(N(mu, sigma^2))`` norms for ``rounds`` rounds.

    Fixed-size rounds of ``clients`` users from a population of ``100 * clients`` (the norms are
    fresh draws every round, as in the paper). ``count_noise_std`` defaults to ``clients / 20``.
    The norms are drawn from a generator seeded with ``seed`` (synthetic data); the DP noise from
    ``PrivateRandomness.reproducible(seed)`` (a simulation, NOT a private run).
    """
    strategy = QuantileClip(initial_clip_norm=initial_clip_norm, target_quantile=gamma,
                            clip_lr=clip_lr, count_noise_std=count_noise_std)
    sampler = make_user_sampler("fixed-size", 100 * clients, clients)
    agg = DPAggregator(strategy, sampler, noise_multiplier, rounds,
                       PrivateRandomness.reproducible(seed))
    g = torch.Generator().manual_seed(int(seed) + 12345)
    clips = [float(agg.state["clip_norm"])]
    for _ in range(rounds):
        norms = torch.exp(mu + sigma * torch.randn(clients, generator=g, dtype=torch.float64))
        agg.aggregate(norms[:, None])
        clips.append(float(agg.state["clip_norm"]))
    return TrackResult(clips, lognormal_quantile(mu, sigma, gamma))
