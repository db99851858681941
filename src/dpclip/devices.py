"""Device resolution and placement: the one function that turns a device name into a torch device.

``"auto"`` (the default of ``dpclip train --device`` and ``TrainConfig.device``) is CUDA when this
torch build sees a CUDA device, else the CPU. The device is an execution setting: it does not
change the mechanism (the same sampler, the same noise standard deviation, the same ledger), only
where the private generators draw (``dpclip.randomness``: each device has its own secret
generator) and where the data and the sums live.

Privacy: nothing here reads data. :func:`data_fits_on_device` reads the size of the training
tensors (public: the dataset size and the example shape) and the device's free memory.
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["DEVICE_NAMES", "data_fits_on_device", "resolve_device"]

#: accepted spellings: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (or a ``torch.device``)
DEVICE_NAMES = ("auto", "cpu", "cuda", "cuda:N")

_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def resolve_device(device: "str | torch.device | None", argument: str = "device"
                   ) -> torch.device:
    """``torch.device`` for ``device`` (``"auto"``/``None``: CUDA when available, else CPU).

    ``argument`` names the option in the error (``--device``, ``make_private(device=...)``,
    ``TrainConfig.device``). Raises ``ValueError`` for an unknown name, for ``cuda`` on a machine
    or torch build without CUDA, and for ``cuda:N`` beyond the visible devices, each with the fix.
    """
    if device is None:
        device = "auto"
    if isinstance(device, torch.device):
        name = str(device)
    elif isinstance(device, str):
        name = device.strip().lower()
    else:
        raise ValueError(f"{argument}: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got "
                         f"{type(device).__name__} {device!r}")
    if not _PATTERN.fullmatch(name):
        raise ValueError(f"{_spell(argument, device)}: unknown device; valid: auto (CUDA when "
                         "available), cpu, cuda, cuda:N")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{_spell(argument, name)}: this torch build or machine has no CUDA device; use "
                f"{_spell(argument, 'cpu')}, or {_spell(argument, 'auto')} to take CUDA only "
                f"where it is present (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"{_spell(argument, name)}: only {torch.cuda.device_count()} CUDA device(s) are "
                f"visible (cuda:0..cuda:{torch.cuda.device_count() - 1}); pick one of them or "
                f"{_spell(argument, 'auto')}")
    return dev


def _spell(argument: str, value: Any) -> str:
    """``--device cuda`` for a CLI flag, ``device='cuda'`` for a Python argument."""
    if argument.startswith("--"):
        return f"{argument} {value}"
    return f"{argument.rstrip('=')}={str(value)!r}"


def _nbytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (tuple, list)):
        return sum(_nbytes(v) for v in tree)
    return 0


def data_fits_on_device(data: Any, device: torch.device, fraction: float = 0.5) -> bool:
    """True when the tensors of ``data`` take at most ``fraction`` of ``device``'s free memory
    (always True on the CPU, where the data already is). The automatic default of
    ``make_private(data_on_device="auto")``: a dataset that fits is copied once, so no step moves
    a batch across PCIe; one that does not stays on the host and each batch is copied."""
    if device.type != "cuda":
        return True
    free, _total = torch.cuda.mem_get_info(device)
    return _nbytes(data) <= fraction * free
