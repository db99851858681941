"""Learning-rate schedules for ``dpclip train``, specs and the harness (``TrainConfig.lr_schedule``).

Post-processing only: the learning rate scales the already-noised, already-accounted gradient, so
a schedule changes no sensitivity, no noise and no privacy event; the ledger of a run is the same
with every schedule (tested). Built on ``torch.optim.lr_scheduler`` and stepped once per optimizer
step (its state is saved in checkpoints, so a resumed run continues the schedule exactly):

=============  ====================================================================================
constant       ``lr`` throughout (the default)
step           ``lr * lr_gamma ** floor(epoch / lr_step_epochs)``: times ``lr_gamma`` every
               ``lr_step_epochs`` epochs (``StepLR`` with ``step_size = lr_step_epochs`` epochs)
exponential    ``lr * lr_gamma ** epoch``: times ``lr_gamma`` at each epoch boundary (Nguyen et
               al.'s ``lr x 0.9`` per epoch; ``StepLR`` with a step size of one epoch)
cosine         ``lr_min + (lr - lr_min) (1 + cos(pi s / S)) / 2`` per step ``s`` of the ``S`` steps
               after the warm-up (``CosineAnnealingLR``; ``lr_min`` defaults to 0)
=============  ====================================================================================

``lr_warmup_epochs = w`` (any schedule) first raises the rate linearly over ``W = round(w x
steps per epoch)`` steps, ``lr * (t + 1) / W`` at step ``t < W`` (``LinearLR``), then the schedule
starts (``SequentialLR``; its epochs count from the end of the warm-up). ``epoch`` above is the
number of whole epochs of steps since the schedule started.
"""

from __future__ import annotations

from typing import Any

import torch
from dpclip.errors import unknown_name

__all__ = ["LR_SCHEDULES", "build_lr_scheduler", "check_lr_schedule", "describe_lr_schedule",
           "warmup_steps"]

#: schedule name -> the TrainConfig fields it uses (besides lr and lr_warmup_epochs)
LR_SCHEDULES: dict[str, tuple[str, ...]] = {
    "constant": (),
    "step": ("lr_gamma", "lr_step_epochs"),
    "exponential": ("lr_gamma",),
    "cosine": ("lr_min",),
}
_FLAGS = {"lr_schedule": "--lr-schedule", "lr_gamma": "--lr-gamma",
          "lr_step_epochs": "--lr-step-epochs", "lr_min": "--lr-min",
          "lr_warmup_epochs": "--lr-warmup-epochs"}


def _flag(name: str) -> str:
    return f"{name} ({_FLAGS[name]})"


def check_lr_schedule(schedule: Any, gamma: Any, step_epochs: Any, lr_min: Any,
                      warmup_epochs: Any, lr: float) -> None:
    """Validate the schedule fields of a ``TrainConfig``; errors name the field and the fix.
    A field the chosen schedule does not use is refused (it would be silently ignored)."""
    if not isinstance(schedule, str) or schedule not in LR_SCHEDULES:
        raise ValueError(f"TrainConfig: {unknown_name('lr_schedule', schedule, LR_SCHEDULES)}")
    given = {"lr_gamma": gamma, "lr_step_epochs": step_epochs, "lr_min": lr_min}
    uses = LR_SCHEDULES[schedule]
    for name, value in given.items():
        if value is not None and name not in uses:
            users = [s for s, f in LR_SCHEDULES.items() if name in f]
            raise ValueError(
                f"TrainConfig: {_flag(name)} is not used by lr_schedule {schedule!r} (only by "
                f"{users}); remove it or choose one of those schedules")
        if value is None and name in uses and name != "lr_min":
            raise ValueError(f"TrainConfig: lr_schedule {schedule!r} needs {_flag(name)}")
    real = (int, float)
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, real)
                              or not 0 < gamma <= 1):
        raise ValueError(f"TrainConfig: {_flag('lr_gamma')} must be a number in (0, 1], got "
                         f"{gamma!r}")
    if step_epochs is not None and (isinstance(step_epochs, bool)
                                    or not isinstance(step_epochs, int) or step_epochs < 1):
        raise ValueError(f"TrainConfig: {_flag('lr_step_epochs')} must be an integer >= 1, got "
                         f"{step_epochs!r}")
    if lr_min is not None and (isinstance(lr_min, bool) or not isinstance(lr_min, real)
                               or not 0 <= lr_min < lr):
        raise ValueError(f"TrainConfig: {_flag('lr_min')} must be a number in [0, lr = {lr:g}), "
                         f"got {lr_min!r}")
    if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, real) \
            or not warmup_epochs >= 0:
        raise ValueError(f"TrainConfig: {_flag('lr_warmup_epochs')} must be a number >= 0, got "
                         f"{warmup_epochs!r}")


def warmup_steps(warmup_epochs: float, steps_per_epoch: int) -> int:
    """Steps of linear warm-up: ``round(warmup_epochs * steps_per_epoch)``."""
    return int(round(float(warmup_epochs) * steps_per_epoch))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str,
                       gamma: float | None, step_epochs: int | None, lr_min: float | None,
                       warmup_epochs: float, steps_per_epoch: int, total_steps: int
                       ) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The ``torch.optim.lr_scheduler`` object for the schedule (``None`` for a constant rate
    without warm-up); call its ``step()`` after every optimizer step."""
    from torch.optim import lr_scheduler as S

    spe = int(steps_per_epoch)
    w = warmup_steps(warmup_epochs, spe)
    if w >= total_steps and w > 0:
        raise ValueError(
            f"TrainConfig: {_flag('lr_warmup_epochs')} {warmup_epochs:g} is {w} steps, not fewer "
            f"than the {total_steps} planned steps; shorten the warm-up")
    main: S.LRScheduler | None
    if schedule == "constant":
        main = None
    elif schedule == "step":
        assert gamma is not None and step_epochs is not None
        main = S.StepLR(optimizer, step_size=int(step_epochs) * spe, gamma=float(gamma))
    elif schedule == "exponential":
        assert gamma is not None
        main = S.StepLR(optimizer, step_size=spe, gamma=float(gamma))
    elif schedule == "cosine":
        main = S.CosineAnnealingLR(optimizer, T_max=max(total_steps - w, 1),
                                   eta_min=float(lr_min or 0.0))
    else:  # checked by TrainConfig
        raise ValueError(f"unknown lr_schedule {schedule!r}")
    if w == 0:
        return main
    warm = S.LinearLR(optimizer, start_factor=1.0 / w, end_factor=1.0,
                      total_iters=max(w - 1, 1))
    if main is None:
        return warm
    return S.SequentialLR(optimizer, [warm, main], milestones=[w])


def describe_lr_schedule(schedule: str, gamma: float | None, step_epochs: int | None,
                         lr_min: float | None, warmup_epochs: float, lr: float,
                         steps_per_epoch: int) -> dict[str, Any]:
    """The schedule as recorded in the run summary and evidence rows."""
    d: dict[str, Any] = {"name": schedule, "lr": lr, "per": "step"}
    for key, value in (("gamma", gamma), ("step_epochs", step_epochs), ("lr_min", lr_min)):
        if value is not None:
            d[key] = value
    if schedule == "cosine" and lr_min is None:
        d["lr_min"] = 0.0
    if warmup_epochs:
        d["warmup_epochs"] = warmup_epochs
        d["warmup_steps"] = warmup_steps(warmup_epochs, steps_per_epoch)
    return d
