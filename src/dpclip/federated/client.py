"""Client side of DP-FedAvg: local SGD on one user's data, returning the model delta.

The client runs ``epochs`` passes of mini-batch SGD over its own examples starting from the global
model and sends ``Delta = theta_local - theta_global`` (flat, float32). The privacy of the round
does not depend on anything done here as long as a client's delta is a function of its own data
(and the global model) alone: the server clips every delta to ``C_t`` whatever the client
computed, so the local shuffling and dropout may follow a public seed (``local_seed``) keyed by
the user's own data (``user_key``), never by its position among the users or by a generator other
clients draw from.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from dpclip.data.base import TensorSplit

__all__ = ["LocalTraining", "check_federated_model", "flat_parameters", "load_flat", "local_seed",
           "local_update", "user_key"]

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
    """Public seed of the local training of ``user`` in ``round_index`` (same in every runtime):
    its shuffling and its model's own randomness (dropout). ``user`` is :func:`user_key` of the
    user's data, never its position in the list of users: removing one user shifted every later
    user's position, and so its shuffling (1.85-2.33 C a round, hundred-and-forty-seventh hostile
    review)."""
    return (int(seed) * 1_000_003 + int(round_index)) * 1_000_033 + int(user)


def user_key(data: TensorSplit) -> int:
    """A 63-bit key of one user's data alone (a hash of its tensors' shapes, dtypes and bytes):
    the same whichever other users the run holds."""
    h = hashlib.blake2b(digest_size=8)
    for t in (data.inputs, data.targets):
        t = t.detach().cpu().contiguous()
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") >> 1


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
    not touched). ``seed`` drives the shuffling of the user's examples and the model's own
    randomness (dropout), both public and both this user's alone: the model draws from torch's
    default generators seeded from ``seed`` for the update, put back after (before, every
    simulated client drew its dropout masks from the one global generator in turn, so one user's
    presence changed every later user's masks: up to 4.8 C in rounds the user was not even
    sampled in; hundred-and-forty-seventh hostile review). A user with no examples returns a zero
    delta.
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
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed((int(seed) * 2_654_435_761 + 1) % (2**63))  # (not the shuffle's stream)
        _local_sgd(model, params, data, training, loss_fn, g, n)
    with torch.no_grad():
        delta = parameters_to_vector(params).detach() - global_params
    for p in params:
        p.grad = None
    return delta


def _local_sgd(model: nn.Module, params: list[Tensor], data: TensorSplit,
               training: LocalTraining, loss_fn: LossFn, g: torch.Generator, n: int) -> None:
    """:func:`local_update`'s epochs of mini-batch SGD (shuffled by ``g``)."""
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
