"""Fixed, data-independent feature maps applied to every example of an image dataset.

Tramer & Boneh (ICLR 2021, "Differentially private learning needs better features (or much more
data)") train linear models on the coefficients of a Scattering Network (Oyallon & Mallat 2015)
and beat end-to-end private CNNs on MNIST, Fashion-MNIST and CIFAR-10 at moderate budgets. The
dataset option ``features`` (image datasets: ``fashion-mnist``, ``mnist``, ``mnist-5k``,
``cifar10``, ``cifar100``) replaces each image by its scattering coefficients before training:

* ``"none"`` (default): the images as they are;
* ``"scattering"``: a 2-D scattering transform with ``J = 2`` scales and ``L = 8`` angles (Tramer &
  Boneh's setting), computed with kymatio (``pip install 'dpclip[features]'``): an image
  ``(C, H, W)`` becomes ``(C (1 + L J + L^2 J (J - 1) / 2), H / 2^J, W / 2^J)`` coefficients, 81
  channels of 7 x 7 for a 28 x 28 grey image;
* ``"scattering:J"`` or ``"scattering:J:L"``: other scales / angles.

Privacy: the map is a fixed function of ONE image (wavelet filters built from ``J``, ``L`` and the
image size, nothing else), so it is a per-example transform of the data like the datasets' fixed
normalisation: it costs no privacy, and the training run's sensitivity argument is unchanged (the
private examples are now the coefficients). That each output depends on its own image only is
tested (``tests/data/test_features.py``: changing one image changes no other example's
coefficients, and an image transformed alone equals the same image transformed in a batch). The
coefficients are as private as the images: they are computed in memory for the run and never
written to disk.

Augmentation (``augment``, crop and flip) acts on images. ``dpclip train`` with both an
augmentation and ``features`` therefore keeps the training images, and each drawn batch is
augmented first and then transformed (``PrivateTraining(features=...)``,
:meth:`Scattering.transform_images`; the K copies of augmentation multiplicity each on its own):
the example's clipped vector is still a function of that one example and of its secret
augmentation parameters, so the argument of :mod:`dpclip.data.augment` holds unchanged. The test
split is transformed once. This costs the transform of every drawn copy at every step (about
1.3 ms per 28x28 image on one core of the project CPU; a GPU is much faster). A dataset that
already holds coefficients is never augmented (``check_features_augment`` refuses it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["FEATURES", "Scattering", "apply_features", "check_features_augment",
           "parse_features"]

#: The feature maps of the dataset option ``features``.
FEATURES = ("none", "scattering")

_GRAMMAR = ("'none', 'scattering' (J 2, L 8: Tramer & Boneh), 'scattering:J' or "
            "'scattering:J:L' (J >= 1 scales, L >= 1 angles)")
_CHUNK = 1024  # images per call of the transform (bounds its memory: ~0.5 GB at 28x28)


@dataclass(frozen=True)
class Scattering:
    """A 2-D scattering transform with ``J`` scales and ``L`` angles (kymatio)."""

    J: int = 2
    L: int = 8

    def __post_init__(self) -> None:
        for name in ("J", "L"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"features: scattering {name} must be an integer >= 1, got "
                                 f"{v!r}; valid: {_GRAMMAR}")

    @property
    def spec(self) -> str:
        """The canonical text (``parse_features(s.spec) == s``)."""
        return f"scattering:{self.J}:{self.L}"

    @property
    def channels_per_input_channel(self) -> int:
        """Coefficients per image channel: orders 0, 1 and 2."""
        return 1 + self.L * self.J + self.L * self.L * self.J * (self.J - 1) // 2

    def output_shape(self, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
        """The coefficients' shape for images of ``input_shape`` ``(C, H, W)``; refuses other
        shapes and sizes not divisible by ``2^J``."""
        if len(input_shape) != 3:
            raise ValueError(f"features {self.spec!r} needs image inputs (C, H, W) per example, "
                             f"got per-example shape {tuple(input_shape)}; use features='none' "
                             "for non-image data")
        c, h, w = input_shape
        step = 2 ** self.J
        if h % step or w % step or h < step or w < step:
            raise ValueError(f"features {self.spec!r}: the image size {h}x{w} must be a multiple "
                             f"of 2^J = {step}; choose a smaller J (e.g. 'scattering:2')")
        return (c * self.channels_per_input_channel, h // step, w // step)

    def describe(self) -> str:
        """One line for the run summary."""
        return (f"scattering transform J={self.J}, L={self.L} (kymatio "
                f"{_kymatio_version()}; Tramer & Boneh 2021): fixed per-example map, no privacy "
                "cost")

    def transform(self, images: Tensor, *, progress: str | None = None) -> Tensor:
        """The coefficients of ``images`` ``(N, C, H, W)`` as float32 ``(N, *output_shape)``,
        computed ``_CHUNK`` images at a time (each image on its own: the transform is per
        example). ``progress``: a tqdm label shown on stderr for long inputs."""
        shape = self.output_shape(tuple(images.shape[1:]))
        n, c, h, w = images.shape
        op = _scattering_op(self.J, self.L, h, w).to(images.device)
        out = torch.empty((n, *shape), dtype=torch.float32, device=images.device)
        starts = range(0, n, _CHUNK)
        if progress is not None and n > 4 * _CHUNK:
            from tqdm import tqdm

            starts = tqdm(starts, desc=progress, unit="chunk", leave=False)
        with torch.no_grad():
            for i in starts:
                x = images[i:i + _CHUNK].to(torch.float32)
                out[i:i + len(x)] = op(x).reshape(len(x), *shape)
        return out


    def transform_images(self, images: Tensor) -> Tensor:
        """:meth:`transform` of images ``(..., C, H, W)`` with any leading dimensions (examples,
        copies of augmentation multiplicity, units): ``(..., *output_shape)``."""
        lead, image = tuple(images.shape[:-3]), tuple(images.shape[-3:])
        flat = self.transform(images.reshape(-1, *image))
        return flat.reshape(*lead, *flat.shape[1:])


def parse_features(value: Any, where: str = "features") -> Scattering | None:
    """``None`` for ``"none"``, else the :class:`Scattering` the text names (errors name the
    valid forms)."""
    if isinstance(value, Scattering):
        return value
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {value!r}; valid: {_GRAMMAR}")
    text = value.strip().lower()
    if text == "none":
        return None
    name, *args = text.split(":")
    if name != "scattering" or len(args) > 2:
        raise ValueError(f"{where}: unknown feature map {value!r}; valid: {_GRAMMAR}")
    try:
        nums = [int(a) for a in args]
    except ValueError:
        raise ValueError(f"{where}: {value!r} has a non-integer J or L; valid: {_GRAMMAR}"
                         ) from None
    return Scattering(*nums)


def apply_features(bundle: Any, features: Any) -> Any:
    """``bundle`` (a :class:`~dpclip.data.base.DatasetBundle` of images) with every train and
    test image replaced by its coefficients; ``bundle`` itself for ``"none"``. The map is
    recorded in ``preprocessing["features"]``."""
    fmap = parse_features(features)
    if fmap is None:
        return bundle
    shape = fmap.output_shape(tuple(bundle.input_shape))
    from dpclip.data.base import TensorSplit

    splits = {}
    for split in ("train", "test"):
        old = getattr(bundle, split)
        splits[split] = TensorSplit(_memo_transform(fmap, old.inputs, f"{bundle.name} {split}"),
                                    old.targets)
    preprocessing = {**bundle.preprocessing, "features": fmap.describe()}
    return dataclasses.replace(bundle, train=splits["train"], test=splits["test"],
                               input_shape=shape, preprocessing=preprocessing)


#: the last inputs transformed in this process, by content (a harness worker runs the trials and
#: seeds of one dataset one after the other): {(spec, sha256 of the inputs, shape): coefficients}.
#: In memory only, like the dataset itself.
_MEMO: dict[tuple[str, str, tuple[int, ...]], Tensor] = {}
_MEMO_SIZE = 2  # the train and the test split


def _memo_transform(fmap: Scattering, inputs: Tensor, label: str) -> Tensor:
    x = inputs.detach().to("cpu", torch.float32).contiguous()
    key = (fmap.spec, hashlib.sha256(memoryview(x.numpy()).cast("B")).hexdigest(),
           tuple(x.shape))
    if key not in _MEMO:
        while len(_MEMO) >= _MEMO_SIZE:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = fmap.transform(x, progress=f"{label}: {fmap.spec}")
    return _MEMO[key].clone()  # the caller owns its copy (a run may move or change its inputs)


def check_features_augment(preprocessing: Any, augment: Any, where: str = "augment") -> None:
    """Refuse augmentation of inputs a feature map produced (module docstring)."""
    if augment is None or str(augment).strip().lower() in ("", "none"):
        return
    if isinstance(preprocessing, dict) and preprocessing.get("features"):
        raise ValueError(
            f"{where}={getattr(augment, 'spec', augment)!r} crops and flips IMAGES, but the "
            f"dataset option features turned them into coefficients ({preprocessing['features']})"
            "; augmenting those would crop feature maps. Augmentation before the transform is "
            "not built: drop the augmentation, or set features='none'")


def _kymatio_version() -> str:
    try:
        from importlib.metadata import version

        return version("kymatio")
    except Exception:  # pragma: no cover - metadata missing
        return "unknown"


@functools.lru_cache(maxsize=4)
def _scattering_op(J: int, L: int, h: int, w: int) -> Any:
    """kymatio's torch 2-D scattering. Imported from its 2-D frontend: ``kymatio.torch`` also
    imports the 3-D frontend, which needs ``scipy.special.sph_harm`` (removed in SciPy 1.17)."""
    try:
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D
    except ImportError as exc:
        raise ImportError(
            f"features='scattering' needs kymatio ({exc}); install it with "
            "pip install 'dpclip[features]' (or pip install kymatio)") from None
    if not math.log2(min(h, w)) >= J:  # (output_shape checked divisibility already)
        raise ValueError(f"features: J={J} is too large for {h}x{w} images")
    return ScatteringTorch2D(J=J, shape=(h, w), L=L)
