"""Per-example image augmentation after private sampling: random crop with padding, random flip.

Nguyen et al. (S1) train BN-LeNet-5 and resnet-18 with "random crop (padding 4) + random
horizontal flip", the usual CIFAR recipe. In DP-SGD the augmentation must be applied to each
SAMPLED example on its own, after the secret subsampling and before the per-example (or
per-unit) gradient is computed and clipped:

* Each augmented example is a randomised function of that one example and of fresh randomness
  drawn for it alone. Its clipped gradient still has norm at most ``C``, so the
  sensitivity of the clipped sum is unchanged. For neighbouring datasets the sum over the larger
  batch equals in law the sum over the smaller batch plus one independent term of norm <= C. The
  augmentation parameters are i.i.d. per drawn example, so their order in the batch does not
  change the law. The Gaussian mechanism's guarantee holds for every value of that term, hence for
  the mixture (joint convexity), and subsampling amplification applies unchanged. No ledger event:
  nothing is released.
* The argument needs the parameters to be unknown to the adversary: they are drawn by position in
  the batch, and a known tape would tie one example's augmentation to the others'. So they come
  from the run's secret sampling generator (:class:`~dpclip.randomness.PrivateRandomness`: OS
  entropy by default, derived from the seed only with ``reproducible_noise``). They are saved with
  the generator in the private checkpoint and never logged.
* Distributed runs draw the parameters of the GLOBAL batch from the shared generator and each rank
  keeps its slice, so the ranks stay in step and release what one process would.
* Nothing is computed from the data: the padding is a constant (``zeros``: 0 in the model's input
  space, which for per-channel-normalised CIFAR is the training mean colour) or the image's own
  border (``reflect``). Test-time evaluation and public data are never augmented.

Grammar (``TrainConfig.augment``, ``--augment``, ``make_private(augment=...)``): ``"none"`` or a
comma-separated list of

* ``crop:P`` or ``crop:P:MODE``: pad ``P`` pixels on every side (``MODE`` ``zeros``, the default,
  or ``reflect``) and cut a window of the original size at a uniformly random offset in
  ``{0..2P} x {0..2P}`` (torchvision ``RandomCrop(size, padding=P)``);
* ``flip``: mirror left-right with probability 1/2 (``RandomHorizontalFlip``).

The crop is applied before the flip. Inputs are images ``(C, H, W)`` per example (any leading
batch or unit dimensions).

Augmentation multiplicity (De et al. 2022: K augmented copies of an example, their gradients
averaged before clipping) is :mod:`dpclip.training.multiplicity`; it draws ``K`` rows of parameters per
example from the same generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dpclip._checks import library_object

__all__ = ["AUGMENT_OPS", "PAD_MODES", "Augmentation", "parse_augment"]

AUGMENT_OPS = ("crop", "flip")
PAD_MODES = ("zeros", "reflect")

_GRAMMAR = ("'none' or a comma-separated list of 'crop:P' (pad P, random crop back to the input "
            "size; 'crop:P:reflect' pads with the mirrored border) and 'flip' (random horizontal "
            "flip), e.g. 'crop:4,flip'")


@dataclass(frozen=True)
class Augmentation:
    """A parsed augmentation: random crop with padding ``crop_pad`` (0: none), then ``flip``."""

    crop_pad: int = 0
    pad_mode: str = "zeros"
    flip: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.crop_pad, int) and self.crop_pad >= 0):
            raise ValueError(f"augment: the crop padding must be an integer >= 0, got "
                             f"{self.crop_pad!r}")
        if self.pad_mode not in PAD_MODES:
            raise ValueError(f"augment: crop padding mode must be one of {PAD_MODES}, got "
                             f"{self.pad_mode!r}")
        if not self.crop_pad and not self.flip:
            raise ValueError("augment: an augmentation needs 'crop:P' (P >= 1) or 'flip'; use "
                             "'none' for no augmentation")

    @property
    def spec(self) -> str:
        """The canonical text (``parse_augment(a.spec) == a``)."""
        parts = []
        if self.crop_pad:
            parts.append(f"crop:{self.crop_pad}" + (
                f":{self.pad_mode}" if self.pad_mode != "zeros" else ""))
        if self.flip:
            parts.append("flip")
        return ",".join(parts)

    def check_example_shape(self, shape: Sequence[int], where: str = "augment") -> None:
        """Refuse inputs that are not images ``(C, H, W)``, or too small for reflect padding."""
        shape = tuple(int(s) for s in shape)
        if len(shape) != 3:
            raise ValueError(
                f"{where}: augmentation {self.spec!r} needs image inputs of shape (C, H, W) per "
                f"example, got per-example shape {shape}. Set it to 'none' for non-image data")
        if self.pad_mode == "reflect" and self.crop_pad >= min(shape[1:]):
            raise ValueError(
                f"{where}: 'crop:{self.crop_pad}:reflect' needs images larger than the padding, "
                f"got {shape[1]}x{shape[2]}; use a smaller P or the zeros padding")

    def draw(self, n: int, generator: torch.Generator) -> Tensor:
        """The parameters of ``n`` examples, ``(n, 3)`` int64 on the generator's device (the GPU
        in a CUDA run: no host round trip): row offset, column offset (in ``0..2P``) and flip
        (0/1). Drawn from ``generator`` (the run's secret sampling generator), the same number of
        draws for every ``n`` per example."""
        dev = generator.device
        params = torch.zeros(n, 3, dtype=torch.int64, device=dev)
        if n and self.crop_pad:
            params[:, :2] = torch.randint(0, 2 * self.crop_pad + 1, (n, 2), generator=generator,
                                          device=dev)
        if n and self.flip:
            params[:, 2] = torch.randint(0, 2, (n,), generator=generator, device=dev)
        return params

    def apply(self, x: Tensor, params: Tensor) -> Tensor:
        """Augment every example of ``x`` (``(..., C, H, W)``; the leading dimensions flattened
        hold ``params.shape[0]`` examples in order) with its own row of ``params``."""
        if not isinstance(x, Tensor):
            raise ValueError(
                f"augment: augmentation {self.spec!r} needs the inputs to be one tensor of images, "
                f"got {type(x).__name__}; set it to 'none' and augment in your own model code")
        if x.ndim < 3:
            self.check_example_shape(tuple(x.shape[1:]))
        lead, (c, h, w) = tuple(x.shape[:-3]), tuple(x.shape[-3:])
        flat = x.reshape(-1, c, h, w)
        n = flat.shape[0]
        if params.shape != (n, 3):
            raise ValueError(f"augment: {n} examples but parameters of shape {tuple(params.shape)}")
        if n == 0:
            return x
        params = params.to(flat.device)
        out = flat
        if self.crop_pad:
            p = self.crop_pad
            padded = F.pad(flat, (p, p, p, p), mode="constant" if self.pad_mode == "zeros"
                           else "reflect")
            rows = params[:, 0, None] + torch.arange(h, device=flat.device)  # (n, h)
            cols = params[:, 1, None] + torch.arange(w, device=flat.device)  # (n, w)
            out = padded[torch.arange(n, device=flat.device)[:, None, None, None],
                         torch.arange(c, device=flat.device)[None, :, None, None],
                         rows[:, None, :, None], cols[:, None, None, :]]
        if self.flip:
            out = torch.where(params[:, 2].bool()[:, None, None, None], out.flip(-1), out)
        return out.reshape(*lead, c, h, w)


def parse_augment(spec: "str | Augmentation | None", where: str = "augment") -> Augmentation | None:
    """``None`` for ``None`` / ``"none"`` / ``""``; otherwise the :class:`Augmentation` (clear
    errors naming ``where`` and the grammar)."""
    if spec is None:
        return spec
    if isinstance(spec, Augmentation):  # (its apply runs on the whole drawn batch before any
        # engine sees it: a subclass's "batch mixup" moved the release by 6.01 C, forty-third
        # review; a function set on the instance, 20.2 C, hundred-and-thirty-ninth): a fresh
        # copy of the library's own class only
        return library_object(spec, Augmentation, where)
    if not isinstance(spec, str):
        raise ValueError(f"{where} must be a string: {_GRAMMAR}; got {type(spec).__name__} "
                         f"{spec!r}")
    text = spec.strip().lower()
    if text in ("", "none"):
        return None
    crop_pad, pad_mode, flip, seen = 0, "zeros", False, set()
    for item in (t.strip() for t in text.split(",")):
        op, *args = item.split(":")
        if op not in AUGMENT_OPS:
            raise ValueError(f"{where}: unknown augmentation {item!r} in {spec!r}; {_GRAMMAR}")
        if op in seen:
            raise ValueError(f"{where}: {op!r} appears twice in {spec!r}; {_GRAMMAR}")
        seen.add(op)
        if op == "flip":
            if args:
                raise ValueError(f"{where}: 'flip' takes no argument, got {item!r}")
            flip = True
        else:
            if not 1 <= len(args) <= 2 or not args[0].isdigit() or int(args[0]) < 1:
                raise ValueError(f"{where}: {item!r} must be 'crop:P' with an integer padding "
                                 f"P >= 1 (or 'crop:P:reflect'), e.g. 'crop:4'")
            crop_pad = int(args[0])
            if len(args) == 2:
                if args[1] not in PAD_MODES:
                    raise ValueError(f"{where}: padding mode {args[1]!r} in {item!r} must be one "
                                     f"of {PAD_MODES}")
                pad_mode = args[1]
    return Augmentation(crop_pad=crop_pad, pad_mode=pad_mode, flip=flip)
