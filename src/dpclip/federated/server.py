"""The DP-FedAvg server: global model, server optimizer and the private aggregator.

:class:`FedAvgServer` is what both runtimes drive (the in-process simulation and the Flower
strategy): ``sample_users()`` picks the round's users, the runtime obtains their deltas,
``finish_round(deltas, users)`` privatizes them (:class:`DPAggregator`) and applies the server
optimizer to the released update. Everything after the aggregator is post-processing.

Server optimizers (on the released mean update ``u_t``, the pseudo-gradient being ``-u_t``):

* ``"sgd"``: ``theta <- theta + eta_s u_t`` (FedAvg with ``eta_s = 1``);
* ``"momentum"``: Andrew et al.'s DP-FedAvg-M, ``v <- beta v + (1 - beta) u_t``,
  ``theta <- theta + eta_s v`` (``v_0 = 0``);
* ``"adam"``: ``torch.optim.Adam`` (Reddi et al.'s FedAdam) on ``-u_t``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from dpclip.federated.aggregator import AggregateOutput, DPAggregator
from dpclip.federated.client import check_federated_model, flat_parameters, load_flat

__all__ = ["SERVER_OPTIMIZERS", "FedAvgServer", "ServerOptimizer", "evaluate"]

SERVER_OPTIMIZERS = ("sgd", "momentum", "adam")


@dataclass(frozen=True)
class ServerOptimizer:
    """Public hyper-parameters of the server optimizer (``eta_s``, ``beta``, Adam's betas/eps)."""

    name: str = "momentum"
    lr: float = 1.0
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-3

    def __post_init__(self) -> None:
        if self.name not in SERVER_OPTIMIZERS:
            raise ValueError(
                f"server optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}, got {self.name!r}")
        if not (math.isfinite(float(self.lr)) and float(self.lr) > 0):
            raise ValueError(f"server lr must be > 0, got {self.lr!r}")
        if not (0 <= float(self.momentum) < 1):
            raise ValueError(f"server momentum must be in [0, 1), got {self.momentum!r}")


class FedAvgServer:
    """Global model + :class:`DPAggregator` + server optimizer (see the module docstring)."""

    def __init__(self, model: nn.Module, aggregator: DPAggregator,
                 optimizer: ServerOptimizer | None = None) -> None:
        check_federated_model(model)
        self.model = model
        self.aggregator = aggregator
        self.opt = optimizer or ServerOptimizer()
        self.theta = flat_parameters(model)
        self._velocity = torch.zeros_like(self.theta)
        self._adam: torch.optim.Adam | None = None
        if self.opt.name == "adam":
            self._theta_param = nn.Parameter(self.theta.clone())
            self._adam = torch.optim.Adam([self._theta_param], lr=self.opt.lr,
                                          betas=self.opt.betas, eps=self.opt.eps)
        self.clip_history: list[float] = []  #: C_t of every round (public)

    @property
    def round_index(self) -> int:
        return self.aggregator.round_index

    def sample_users(self) -> list[int]:
        return self.aggregator.sample_users()

    def finish_round(self, deltas: Tensor | list[Tensor], users: list[int] | None = None
                     ) -> AggregateOutput:
        """Privatize the round's deltas (one per sampled user, or ``(0, d)`` for none) and step."""
        if isinstance(deltas, list) and not deltas:
            deltas = torch.zeros(0, self.theta.numel())
        _check_round(deltas, users, self.theta.numel())  # before anything is recorded
        out = self.aggregator.aggregate(deltas, users)
        self.apply_update(out.update)
        self.clip_history.append(out.clip_norm)
        return out

    def apply_update(self, update: Tensor) -> None:
        """Server optimizer step on the released update (post-processing)."""
        u = update.to(self.theta.dtype)
        if self.opt.name == "sgd":
            self.theta = self.theta + self.opt.lr * u
        elif self.opt.name == "momentum":
            b = self.opt.momentum
            self._velocity = b * self._velocity + (1 - b) * u
            self.theta = self.theta + self.opt.lr * self._velocity
        else:
            assert self._adam is not None
            self._theta_param.grad = -u
            self._adam.step()
            self.theta = self._theta_param.detach().clone()
        self.load_into(self.model)

    def load_into(self, model: nn.Module) -> None:
        load_flat(model, self.theta)

    def describe(self) -> dict[str, Any]:
        return {**self.aggregator.describe(), "server_optimizer": self.opt.name,
                "server_lr": self.opt.lr, "server_momentum": self.opt.momentum}


def evaluate(model: nn.Module, inputs: Tensor, targets: Tensor, batch_size: int = 2048,
             loss_fn: Callable[..., Tensor] | None = None,
             ignore_index: int | None = None) -> tuple[float, float]:
    """(accuracy, mean loss) of ``model`` on a centralised (public test) split.

    Sequence tasks (targets ``(n, L)``, outputs ``(n, classes, L)``) are scored per target token;
    tokens equal to ``ignore_index`` (padding) count in neither the accuracy nor the loss (give a
    ``loss_fn`` that ignores them too, e.g. ``FederatedData.loss_fn()``)."""
    loss_fn = loss_fn or nn.functional.cross_entropy
    model.eval()
    correct, loss, n = 0, 0.0, 0
    with torch.no_grad():
        for s in range(0, int(targets.shape[0]), batch_size):
            out = model(inputs[s:s + batch_size])
            y = targets[s:s + batch_size]
            keep = torch.ones_like(y, dtype=torch.bool) if ignore_index is None \
                else y != ignore_index
            loss += float(loss_fn(out, y, reduction="sum"))
            correct += int(((out.argmax(1) == y) & keep).sum())
            n += int(keep.sum())
    model.train()
    return correct / max(n, 1), loss / max(n, 1)


def _check_round(deltas: Tensor | list[Tensor], users: list[int] | None, d: int) -> None:
    """Refuse a round the aggregator must not privatize, before it records anything: a delta
    that is not of the model's size, or a user listed twice (its influence would be doubled)."""
    sizes = [int(t.shape[-1]) if t.ndim else 1 for t in deltas] if isinstance(deltas, list) \
        else ([int(deltas.shape[1])] if deltas.ndim == 2 and deltas.shape[0] else [])
    if isinstance(deltas, Tensor) and deltas.ndim != 2:
        raise ValueError(f"finish_round: deltas must be a (clients, {d}) tensor")
    if any(s != d for s in sizes):
        raise ValueError(f"finish_round: every delta must have the model's {d} parameters; "
                         "nothing was recorded")
    if users is not None and len(set(users)) != len(users):
        raise ValueError("finish_round: a user is listed twice; each sampled user contributes "
                         "one delta (nothing was recorded)")
