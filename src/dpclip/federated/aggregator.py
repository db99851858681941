"""The server's differentially private aggregation of client updates: one DP-FedAvg round.

User-level DP-FedAvg (McMahan et al. 2018; Andrew et al. 2021, algorithms.md M6) is DP-SGD with
the user as the privacy unit and the user's model delta as the "per-example gradient"::

    users      <- sampler.sample(randomness.sampling)        Poisson rate q, or m of N (replace-one)
    norms      <- ||Delta_u||                                  (float64, one per sampled user)
    w_u        <- strategy.weights(norms, state)              clip factor, ||w_u Delta_u|| <= C_t
    sum        <- sum_u a_u w_u Delta_u                       a_u: declared public weight <= a_max
    noisy      <- sum + N(0, (z_Delta k a_max C_t)^2 I)       k = sampler.sensitivity_factor
    update     <- noisy / expected_weight                     public constant (m = q N for a_u = 1)
    state', ev <- strategy.update(state, norms, ctx, release) the quantile count, Thm-1 split
    ledger     += sampler.step_event(compose(Gaussian(z_Delta), *ev))

Every norm-based flat strategy of ``dpclip.clipping`` works unchanged: ``fixed``, ``quantile``
(geometric or linear update, centred count ``sum_u (1[n_u <= C_t] - 1/2)`` with its own
``sigma_b``, the noise split of Theorem 1 in ``strategy.noise_multiplier``), the schedules
(``yu-linear``, ``lin-decay``, ``du-dynamic``, ...), Auto-S / PSAC. The strategy's
``StepContext`` is filled with public facts of the round: ``step = epoch = round``,
``steps_per_epoch = 1``, ``total_steps = rounds`` and ``expected_batch_size = m`` (the expected
number of sampled users, which is also the count's public denominator).

The noise is formed with the clip of the round (``C_t``, read before ``strategy.update``), never the
updated one. The sum is accumulated in float64 and clipped there, so the norm that sets a weight
upper-bounds the norm of the vector actually summed (rounding included; checked at run time).

:class:`DPAggregator` is the one implementation used by the in-process simulation
(``dpclip.federated.simulation``) and by the Flower server strategy (``dpclip.federated.flower``),
so both produce the same ledger for the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from dpclip.accounting import Ledger
from dpclip.clipping.base import ClippingStrategy, State, StepContext
from dpclip.clipping.capabilities import capabilities_of, strategy_name
from dpclip.events import DpEvent
from dpclip.randomness import PrivateRandomness
from dpclip.training.plan import Plan
from dpclip.training.release import release
from dpclip.training.sampling import FixedSizeSampler, PoissonSampler, Sampler

__all__ = [
    "AggregateOutput",
    "DPAggregator",
    "UserWeights",
    "check_federated_strategy",
    "make_user_sampler",
    "round_context",
]

#: Sampling schemes of users (the names of ``dpclip.training.sampling``).
USER_SAMPLING = ("poisson", "fixed-size")


def make_user_sampler(sampling: str, num_users: int, clients_per_round: float) -> Sampler:
    """The sampler of users: ``"poisson"`` (each user joins a round with probability
    ``q = clients_per_round / num_users``; add/remove-one adjacency of users) or ``"fixed-size"``
    (exactly ``clients_per_round`` users, uniformly without replacement; replace-one adjacency,
    sensitivity factor 2, account with ``accountant="rdp"``).
    """
    if sampling not in USER_SAMPLING:
        raise ValueError(
            f"sampling must be one of {', '.join(USER_SAMPLING)}, got {sampling!r}"
        )
    if isinstance(num_users, bool) or not isinstance(num_users, int) or num_users < 1:
        raise ValueError(f"num_users must be an int >= 1, got {num_users!r}")
    if not (math.isfinite(float(clients_per_round)) and 0 < clients_per_round <= num_users):
        raise ValueError(
            f"clients_per_round must be in (0, num_users={num_users}], got {clients_per_round!r}"
        )
    if sampling == "fixed-size":
        if float(clients_per_round) != int(clients_per_round):
            raise ValueError(
                f"fixed-size sampling needs an integer clients_per_round, got {clients_per_round!r}"
            )
        return FixedSizeSampler(num_users, int(clients_per_round))
    return PoissonSampler(num_users, float(clients_per_round))


def check_federated_strategy(strategy: ClippingStrategy) -> None:
    """Refuse strategies the server cannot apply to flat client deltas (named, with the fix)."""
    name = strategy_name(strategy)
    if capabilities_of(strategy).bound_based:
        raise ValueError(
            f"strategy {name!r} is bound-based (sensitivity from the weights); DP-FedAvg clips "
            "client deltas by norm: use fixed, quantile or a schedule"
        )
    if capabilities_of(strategy).per_example_grads:
        raise ValueError(
            f"strategy {name!r} transforms per-example gradients (P-GRAD); DP-FedAvg clips client "
            "deltas by norm: use fixed, quantile or a schedule"
        )
    if capabilities_of(strategy).per_group:
        raise ValueError(
            f"strategy {name!r} clips per parameter group; dpclip.federated clips the whole "
            "client delta (flat norm): use fixed, quantile or a schedule"
        )


def round_context(round_index: int, total_rounds: int, expected_clients: float,
                  base_noise_multiplier: float) -> StepContext:
    """The public ``StepContext`` of round ``round_index`` (0-based): one round is one step and
    one "epoch" (schedules move per round); ``expected_batch_size`` is the expected number of
    sampled users ``m`` (the quantile count's public denominator and ``sigma_b = m/20``).
    The same context as ``Plan.for_rounds(...).ctx`` (:class:`dpclip.training.plan.Plan`)."""
    return Plan.context(round_index, steps_per_epoch=1, total_steps=total_rounds,
                        units=float(expected_clients), base=float(base_noise_multiplier))


@dataclass(frozen=True)
class UserWeights:
    """Declared, PUBLIC per-user weights ``a_u`` in ``[0, max_weight]`` (weighted DP-FedAvg).

    McMahan et al. 2018's bounded-weight estimator: user ``u``'s clipped delta counts ``a_u`` times
    (e.g. ``a_u = min(n_u / n_cap, 1)``), so the L2 sensitivity of the weighted sum is
    ``max_weight * C`` and the update is divided by the public expected total weight
    ``q * sum_u a_u`` (Poisson) or ``m/N * sum_u a_u`` (fixed-size). The weights must not depend on
    private data beyond what the user is willing to publish: they are public inputs of the plan.
    The count of the quantile strategy stays unweighted (each user's centred bit has sensitivity
    1/2).
    """

    weights: tuple[float, ...]
    max_weight: float = 1.0

    def __post_init__(self) -> None:
        w = tuple(float(x) for x in self.weights)
        object.__setattr__(self, "weights", w)
        cap = float(self.max_weight)
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"UserWeights: max_weight must be finite and > 0, got {cap!r}")
        bad = [i for i, x in enumerate(w) if not (math.isfinite(x) and 0 <= x <= cap)]
        if bad:
            raise ValueError(
                f"UserWeights: every weight must be in [0, max_weight={cap:g}]; user {bad[0]} has "
                f"{w[bad[0]]!r}. Cap the weights (a_u = min(n_u / n_cap, 1)) or raise max_weight "
                "(the sensitivity grows with it)"
            )
        if sum(w) <= 0:
            raise ValueError("UserWeights: the weights sum to 0; give at least one positive weight")

    @classmethod
    def capped_counts(cls, counts: Sequence[int], cap: int) -> "UserWeights":
        """``a_u = min(n_u / cap, 1)`` from the users' example counts (declared public)."""
        if not (isinstance(cap, int) and cap >= 1):
            raise ValueError(f"UserWeights.capped_counts: cap must be an int >= 1, got {cap!r}")
        return cls(tuple(min(int(n) / cap, 1.0) for n in counts), 1.0)

    def expected_total(self, sampler: Sampler) -> float:
        """``E[sum of the sampled users' weights] = (m / N) sum_u a_u`` (public)."""
        if len(self.weights) != sampler.dataset_size:
            raise ValueError(
                f"UserWeights has {len(self.weights)} weights for {sampler.dataset_size} users"
            )
        return sampler.expected_batch_size / sampler.dataset_size * sum(self.weights)


@dataclass
class AggregateOutput:
    """One round's released update and its bookkeeping."""

    update: Tensor  #: the privatized mean update (float32, flat), what the server optimizer uses
    state: State  #: the strategy state after the round (``C_{t+1}`` for quantile)
    event: DpEvent  #: the round's ledger entry
    clip_norm: float  #: ``C_t`` (the round's clip; public: a function of earlier releases)
    noise_multiplier: float  #: ``z_Delta`` used on the sum
    noise_std: float  #: std of the noise added to the SUM (``z_Delta k a_max C_t``)
    num_clients: int  #: NON-PRIVATE (realised number of sampled users), diagnostics only
    norms: Tensor  #: NON-PRIVATE delta norms, diagnostics only


@dataclass
class DPAggregator:
    """Server side of user-level DP-FedAvg: sampling of users, clip, sum, noise, ledger.

    Args:
        strategy: a flat norm-based clipping strategy (``fixed``, ``quantile``, schedules, ...).
        sampler: from :func:`make_user_sampler` (its ``dataset_size`` is the number of users ``N``).
        noise_multiplier: the run's base multiplier ``z`` (for ``quantile``, ``z_Delta`` on the sum
            follows from Theorem 1 and the ledger composes ``Gaussian(z_Delta)`` with the count's
            ``Gaussian(2 sigma_b)``: exactly ``Gaussian(z)``).
        rounds: planned number of rounds (public; schedules read it).
        randomness: owns the sampling and noise generators (``PrivateRandomness.secure()`` unless
            reproducible research runs are wanted, which are labelled NOT private).
        user_weights: ``None`` (equal weighting, the default) or declared :class:`UserWeights`.

    Privacy: each round is one ``sampler.step_event(...)`` in :attr:`ledger`; the user-level
    epsilon is ``dpclip.accounting.compute_epsilon(aggregator.ledger, delta)``. The released update
    is the only output computed from the deltas; norms and the realised client count in
    :class:`AggregateOutput` are NON-PRIVATE diagnostics.
    """

    strategy: ClippingStrategy
    sampler: Sampler
    noise_multiplier: float
    rounds: int
    randomness: PrivateRandomness
    user_weights: UserWeights | None = None
    state: State = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)
    round_index: int = 0
    #: the public plan of the rounds (built from the fields above; every round is checked on it)
    plan: Plan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_federated_strategy(self.strategy)
        z = float(self.noise_multiplier)
        if not (math.isfinite(z) and z >= 0):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier!r}")
        self.noise_multiplier = z
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be an int >= 1, got {self.rounds!r}")
        if not isinstance(self.randomness, PrivateRandomness):
            raise TypeError(
                "randomness must be a dpclip.randomness.PrivateRandomness (PrivateRandomness."
                f"secure(), or .reproducible(seed) for NOT private research runs), got "
                f"{type(self.randomness).__name__}"
            )
        if not self.state:
            self.state = self.strategy.init_state()
        if self.user_weights is not None:
            self.user_weights.expected_total(self.sampler)  # validates the length
        self.plan = Plan.for_rounds(self.strategy, self.sampler, self.rounds)
        # fail now, not at round 1, when the noise split is impossible (quantile: z >= 2 sigma_b)
        self.plan.event(0, z)

    # -- public facts ---------------------------------------------------------------------------
    @property
    def expected_clients(self) -> float:
        """``m``: expected number of sampled users per round (public)."""
        return self.sampler.expected_batch_size

    @property
    def denominator(self) -> float:
        """The public constant the noisy sum is divided by: ``m`` or the expected total weight."""
        if self.user_weights is None:
            return self.expected_clients
        return self.user_weights.expected_total(self.sampler)

    @property
    def max_weight(self) -> float:
        return 1.0 if self.user_weights is None else self.user_weights.max_weight

    def context(self, round_index: int) -> StepContext:
        return self.plan.ctx(round_index, self.noise_multiplier)

    def planned_event(self, round_index: int) -> DpEvent:
        """The ledger entry round ``round_index`` will record (for calibration and plans)."""
        return self.plan.event(round_index, self.noise_multiplier)

    # -- one round ------------------------------------------------------------------------------
    def sample_users(self) -> list[int]:
        """The users of the next round (sorted; may be empty under Poisson sampling). Drawn from
        ``randomness.sampling``: which users took part is secret."""
        return [int(i) for i in self.sampler.sample(self.randomness.sampling)]

    def aggregate(self, deltas: Tensor | Sequence[Tensor],
                  users: Sequence[int] | None = None) -> AggregateOutput:
        """Clip, sum, noise and normalise the deltas of this round's users; record the event.

        ``deltas``: a ``(clients, d)`` tensor or a sequence of flat ``(d,)`` tensors, one per
        sampled user (an empty round passes a ``(0, d)`` tensor: the update is pure noise and the
        round is still recorded). ``users``: their ids (needed only with ``user_weights``).
        """
        if self.round_index >= self.rounds:
            raise RuntimeError(
                f"aggregate: all {self.rounds} planned rounds are done (the noise was calibrated "
                "and the epsilon computed for that many); plan more rounds instead (DPAggregator("
                "rounds=...), FedAvgConfig(rounds=...), --rounds), which re-calibrates the noise")
        d = _stack(deltas)
        n = d.shape[0]
        if self.user_weights is not None:
            if users is None or len(users) != n:
                raise ValueError(
                    "aggregate: with user_weights, pass users= (one id per delta) so each delta "
                    "gets its declared weight"
                )
            a = torch.tensor([self.user_weights.weights[u] for u in users], dtype=torch.float64)
        else:
            a = torch.ones(n, dtype=torch.float64)
        ctx = self.context(self.round_index)
        state = self.strategy.begin_step(self.state, ctx)
        d64 = d.to(torch.float64)
        norms = torch.linalg.vector_norm(d64, dim=1) if n else torch.zeros(0, dtype=torch.float64)
        w = self.strategy.weights(norms, state).to(torch.float64)
        clip = float(self.strategy.sensitivity(state))  # C_t: the clip of THIS round
        if n:
            w = torch.where(torch.isfinite(norms), w, torch.zeros_like(w))
            clipped = d64 * w[:, None]
            clipped = torch.nan_to_num(clipped, nan=0.0, posinf=0.0, neginf=0.0)
            summed_norms = torch.linalg.vector_norm(clipped, dim=1)
            if bool((summed_norms > clip * (1 + 1e-12)).any()):
                raise RuntimeError(
                    "DPAggregator: a clipped delta exceeds the sensitivity bound "
                    f"(max norm {float(summed_norms.max()):.17g} > C_t = {clip:.17g}); the strategy's "
                    "weights do not bound the norm of the summed vector"
                )
            total = (clipped * a[:, None]).sum(dim=0)
        else:
            total = torch.zeros(d.shape[1], dtype=torch.float64)
        k = self.sampler.sensitivity_factor
        z = float(self.strategy.noise_multiplier(state, self.noise_multiplier))
        out = release(
            {"update": total}, noise_multiplier=z, sensitivity=k * self.max_weight * clip,
            divisor=self.denominator, generator=self.randomness.noise, strategy=self.strategy,
            state=state, norms=norms, ctx=ctx, sampler=self.sampler, sensitivity_factor=k,
            per_tensor=True)
        update = out.values["update"].to(d.dtype if d.is_floating_point() else torch.float32)
        std, event = float(out.std), out.event  # type: ignore[arg-type]
        self.plan.check_emitted(ctx, self.noise_multiplier, event, "round")  # before the ledger
        self.ledger.record(event)
        self.state = dict(out.state)
        self.round_index += 1
        return AggregateOutput(update=update, state=self.state, event=event, clip_norm=clip,
                               noise_multiplier=z, noise_std=std, num_clients=n,
                               norms=norms.detach())

    def describe(self) -> dict[str, Any]:
        """Public facts of the aggregation (stored with every run)."""
        return {
            "strategy": strategy_name(self.strategy),
            "params": self.strategy.describe(),
            "sampling": self.sampler.name,
            "adjacency": self.sampler.adjacency,
            "num_users": self.sampler.dataset_size,
            "expected_clients": self.expected_clients,
            "sample_rate": self.sampler.sample_rate,
            "noise_multiplier": self.noise_multiplier,
            "weighting": "equal" if self.user_weights is None else "declared-capped",
            "privacy_unit": "user",
            **self.randomness.describe(),
        }


def _stack(deltas: Tensor | Sequence[Tensor]) -> Tensor:
    if isinstance(deltas, Tensor):
        if deltas.dim() != 2:
            raise ValueError(
                f"deltas must be a (clients, d) tensor, got shape {tuple(deltas.shape)}; an empty "
                "round is a (0, d) tensor"
            )
        return deltas.detach()
    deltas = list(deltas)
    if not deltas:
        raise ValueError("an empty round needs the model size: pass torch.zeros(0, d)")
    flat = [t.detach().reshape(-1) for t in deltas]
    sizes = {t.numel() for t in flat}
    if len(sizes) != 1:
        raise ValueError(f"client deltas have different sizes {sorted(sizes)}")
    return torch.stack(flat)
