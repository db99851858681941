"""Client side of DP-FedAvg: local SGD on one user's data, returning the model delta.

The client runs ``epochs`` passes of mini-batch SGD over its own examples starting from the global
model and sends ``Delta = theta_local - theta_global`` (flat, float32). The privacy of the round
does not depend on anything done here: the server clips every delta to ``C_t`` whatever the
client computed, so the local shuffling may follow a public seed (``local_seed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from dpclip.data.base import TensorSplit

__all__ = ["LocalTraining", "check_federated_model", "flat_parameters", "load_flat", "local_seed",
           "local_update"]

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class LocalTraining:
    """Public hyper-parameters of a client's local training (the paper's ``eta_c``, ``E``)."""

    epochs: int = 1
    batch_size: int = 16
    lr: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"LocalTraining: epochs must be an int >= 1, got {self.epochs!r}")
        if (isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int)
                or self.batch_size < 1):
            raise ValueError(
                f"LocalTraining: batch_size must be an int >= 1, got {self.batch_size!r}")
        if not (math.isfinite(float(self.lr)) and float(self.lr) > 0):
            raise ValueError(f"LocalTraining: lr (client learning rate) must be > 0, got {self.lr!r}")


def check_federated_model(model: nn.Module) -> None:
    """Refuse models with buffers: only parameters are sent, so a buffer updated from a user's data
    (BatchNorm running statistics) would neither be aggregated nor privatized."""
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        raise ValueError(
            f"dpclip.federated trains parameters only; the model has buffer(s) {buffers[:3]} "
            "(e.g. BatchNorm running statistics) that local training would update from private "
            "data without aggregation or noise. Use GroupNorm/LayerNorm or a model without buffers"
        )


def flat_parameters(model: nn.Module) -> Tensor:
    """The model's trainable parameters as one flat float32 vector (a copy)."""
    return parameters_to_vector([p for p in model.parameters() if p.requires_grad]).detach().clone()


def load_flat(model: nn.Module, flat: Tensor) -> None:
    """Copy ``flat`` into the model's trainable parameters (copies: the parameters never share
    storage with ``flat``, so training the model cannot change the vector it started from)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"flat parameter vector has {flat.numel()} entries, the model {total}")
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def local_seed(seed: int, round_index: int, user: int) -> int:
    """Public seed of the local shuffling of ``user`` in ``round_index`` (same in every runtime)."""
    return (int(seed) * 1_000_003 + int(round_index)) * 1_000_033 + int(user)


def local_update(
    model: nn.Module,
    global_params: Tensor,
    data: TensorSplit,
    training: LocalTraining,
    *,
    loss_fn: LossFn | None = None,
    seed: int = 0,
) -> Tensor:
    """Run local SGD from ``global_params`` on ``data``; return ``theta_local - theta_global``.

    ``model`` is a working copy whose parameters are overwritten (the caller's global model is
    not touched). ``seed`` drives the shuffling of the user's examples (public). A user with no
    examples returns a zero delta.
    """
    loss_fn = loss_fn or nn.functional.cross_entropy
    params = [p for p in model.parameters() if p.requires_grad]
    load_flat(model, global_params)
    n = len(data)
    if n == 0:
        return torch.zeros_like(global_params)
    g = torch.Generator()
    g.manual_seed(int(seed) % (2**63))
    model.train()
    for _ in range(training.epochs):
        order = torch.randperm(n, generator=g)
        for start in range(0, n, training.batch_size):
            idx = order[start:start + training.batch_size]
            for p in params:
                p.grad = None
            loss = loss_fn(model(data.inputs[idx]), data.targets[idx])
            loss.backward()
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-training.lr)
    with torch.no_grad():
        delta = parameters_to_vector(params).detach() - global_params
    for p in params:
        p.grad = None
    return delta
