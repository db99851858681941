"""Hundred-and-thirty-ninth hostile review: the library's own per-example maps that run on the
whole drawn batch before any engine sees it (the augmentation, the feature map) were accepted by
their exact type only (forty-third review refused subclasses). ``object.__setattr__(aug, "apply",
f)`` put a function in a frozen dataclass instance's ``__dict__``, hiding the class's method with
the type unchanged: ``x + 50 x.sum(0)`` on the drawn batch moved the released clipped sum by
20.2 C under every engine (2.87 C on random data). The ``preprocess=`` release was accepted by
its method names: an ``apply`` that added the raw training sum to every record, 22.4 C. Now each
is refused unless it is the library's own class holding only its fields, and is used as a fresh
copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpclip
from dpclip.data.augment import Augmentation, parse_augment
from dpclip.data.features import Scattering
from dpclip.data.private_centre import PrivateCentre

DT = torch.float64
N = 16


def _mixes(x, *args):  # every example gets the drawn batch's sum
    return x + 50.0 * x.sum(0, keepdim=True)


def _released(x, y, engine, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(x[0].numel(), 3)).to(DT)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    dp = dpclip.make_private(model, opt, (x, y), strategy="fixed",
                             strategy_params={"clip_norm": 1.0}, noise_multiplier=0.0, steps=1,
                             batch_size=float(len(x)), engine=engine, verbose=False, **kw)
    xb, yb = dp.sample()
    dp.backward(xb, yb)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]) * len(x)


def _target():
    """One example with data, the others zero: mixed, every other input is the target's."""
    g = torch.Generator().manual_seed(3)
    x = torch.zeros(N, 1, 4, 4, dtype=DT)
    x[0] = torch.randn(1, 4, 4, generator=g, dtype=DT)
    return x, torch.ones(N, dtype=torch.long)


@pytest.mark.parametrize("engine", ["auto", "vmap"])
def test_a_method_set_on_the_augmentation_instance_is_refused(engine):
    x, y = _target()
    aug = Augmentation(flip=True)
    object.__setattr__(aug, "apply", _mixes)
    with pytest.raises(TypeError, match="attributes of its own \\(apply\\)"):
        full = _released(x, y, engine, augment=aug)
        part = _released(x[1:], y[1:], engine, augment=aug)
        assert float((full - part).norm()) <= 1.0 + 1e-9  # (before: 20.2 C)


def test_a_method_set_on_the_feature_map_instance_is_refused():
    x, y = _target()
    x = torch.zeros(N, 1, 8, 8, dtype=DT)
    x[0] = torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(3), dtype=DT)
    feat = Scattering(J=1, L=2)
    object.__setattr__(feat, "transform_images", lambda imgs: _mixes(imgs))
    with pytest.raises(TypeError, match="attributes of its own \\(transform_images\\)"):
        _released(x, y, "auto", features=feat)


class _Duck:
    """``PrivateCentre``'s release (accounted) with an ``apply`` that adds the raw sum."""

    name = "duck"

    def __init__(self):
        self.inner = PrivateCentre(8.0)

    def event(self):
        return self.inner.event()

    def release(self, x, n, releaser):
        return self.inner.release(x, n, releaser)

    def describe(self, *a):
        return self.inner.describe(*a)

    def apply(self, x, out):
        return x + x.sum(0, keepdim=True)


def test_a_preprocessing_release_of_another_class_is_refused():
    x, y = _target()
    x = x.reshape(N, -1)
    with pytest.raises(TypeError, match="preprocess= must be a dpclip.data.private_centre"):
        _released(x, y, "auto", preprocess=_Duck())
    centre = PrivateCentre(8.0)
    object.__setattr__(centre, "apply", lambda x, out: x + x.sum(0, keepdim=True))
    with pytest.raises(TypeError, match="attributes of its own \\(apply\\)"):
        _released(x, y, "auto", preprocess=centre)


def test_the_library_objects_are_used_as_fresh_equal_copies():
    aug = Augmentation(crop_pad=2, flip=True)
    got = parse_augment(aug)
    assert got == aug and got is not aug and type(got) is Augmentation
    x, y = _target()
    _released(x, y, "auto", augment=aug)  # (accepted: the library's own, unchanged)
    _released(x.reshape(N, -1), y, "auto", preprocess=PrivateCentre(8.0))


# ---------------------------------------------------------------- review 142: hostile fields

class _Flip:
    """A ``flip`` whose ``__bool__`` runs inside ``Augmentation.apply`` on the drawn batch."""

    def __bool__(self):
        return True


class _Z(float):
    """A noise multiplier whose ``__float__`` runs inside ``PrivateCentre.release``."""

    def __float__(self):
        return 8.0


def test_a_field_that_is_not_a_plain_value_is_refused():
    """Hundred-and-forty-second hostile review: the fresh copy kept the fields as they were; a
    field's own methods (``__bool__``, ``__float__``) ran on the private data through the
    caller's frame (15.2 C, 20.2 C). Every field must be a plain bool, int, float or str."""
    x, y = _target()
    with pytest.raises(TypeError, match="Augmentation.flip is a _Flip"):
        _released(x, y, "auto", augment=Augmentation(flip=_Flip()))
    with pytest.raises(TypeError, match="PrivateCentre.noise_multiplier is a _Z"):
        _released(x.reshape(N, -1), y, "auto", preprocess=PrivateCentre(_Z(8.0)))


# ---------------------------------------------------------------- review 147: drawing errors

def test_an_error_while_forming_the_drawn_batch_quotes_no_number(monkeypatch):
    """Hundred-and-forty-seventh hostile review: an error raised in ``sample()`` (a malformed
    record's collate) left with torch's message, which quoted the record's shape and its
    position in the secret batch; it is scrubbed as the step's errors are."""
    from torch.utils.data import Dataset

    monkeypatch.delenv("DPCLIP_SHOW_PRIVATE_ERRORS", raising=False)

    class _Odd(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = [torch.randn(4, generator=g) for _ in range(40)]
            self.x[7] = torch.randn(5, generator=g)  # (one record of another shape)

        def __len__(self):
            return 40

        def __getitem__(self, i):
            return self.x[i], i % 3

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    dp = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), _Odd(),
                             noise_multiplier=1.0, steps=60, batch_size=8, verbose=False)
    with pytest.raises(RuntimeError) as got:
        for _ in range(60):
            dp.step(*dp.sample())
    assert "numbers removed" in str(got.value)
    assert not any(ch.isdigit() for ch in str(got.value).split(" [numbers removed")[0])
