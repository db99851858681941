"""Devices and the per-device secret generators (issue 32): ``dpclip.devices`` and the device side
of ``dpclip.randomness``. The CUDA tests run where a GPU is present and are skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpclip
from dpclip.devices import resolve_device
from dpclip.noise import add_gaussian_noise_all
from dpclip.randomness import (
    REKEY_OFFSET,
    PrivateRandomness,
    philox_state,
    read_philox_state,
)
from dpclip.training.sampling import PoissonSampler

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")


def _draws(rng: PrivateRandomness) -> tuple[torch.Tensor, torch.Tensor]:
    idx = PoissonSampler(1000, 100.0).sample(rng.sampling)
    z = add_gaussian_noise_all({"w": torch.zeros(64, device=rng.device)}, 1.0, rng.noise)["w"]
    return idx.cpu(), z.cpu()


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)).to(device)


def _data(n: int = 200):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


# ---------------------------------------------------------------------------- device resolution

def test_resolve_device_auto_and_errors_name_the_argument():
    assert resolve_device("auto") == resolve_device(None)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"--device gpu: unknown device; valid: auto"):
        resolve_device("gpu", "--device")
    with pytest.raises(ValueError, match=r"device='tpu': unknown device"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="expected 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device(3)  # type: ignore[arg-type]


@no_cuda
def test_cuda_without_cuda_is_a_clear_error_for_the_api():
    x, y = _data()
    with pytest.raises(ValueError, match=r"device='cuda': this torch build or machine has no "
                                         r"CUDA device; use device='cpu', or device='auto'"):
        dpclip.make_private(_model(), None, (x, y), noise_multiplier=1.0, epochs=1,
                            batch_size=20, device="cuda", verbose=False)
    with pytest.raises(ValueError, match=r"--device cuda:1: this torch build"):
        resolve_device("cuda:1", "--device")


def test_data_on_device_is_validated_and_the_default_trains_on_the_models_device():
    x, y = _data()
    with pytest.raises(ValueError, match="data_on_device must be True, False or 'auto'"):
        dpclip.make_private(_model(), None, (x, y), noise_multiplier=1.0, epochs=1,
                            batch_size=20, device="cpu", data_on_device="yes", verbose=False)
    with pytest.raises(ValueError, match=r"data_on_device=True needs device="):
        dpclip.make_private(_model(), None, (x, y), noise_multiplier=1.0, epochs=1,
                            batch_size=20, data_on_device=True, verbose=False)
    dp = dpclip.make_private(_model(), None, (x, y), noise_multiplier=1.0, epochs=1,
                             batch_size=20, device="auto", verbose=False)
    assert dp.rng.device.type == dp.device.type
    assert dp.describe()["generator"] == ("philox4x32-10" if dp.device.type == "cuda"
                                          else "mt19937")


# ------------------------------------------------------------------------- the generator state

def test_philox_state_layout_round_trips_and_unknown_layouts_raise():
    s = philox_state(0xDEADBEEF12345678, 4 * 12345)
    assert s.dtype == torch.uint8 and s.numel() == 16
    assert read_philox_state(s) == (0xDEADBEEF12345678, 4 * 12345)
    with pytest.raises(RuntimeError, match="cannot read torch .*CUDA generator state"):
        read_philox_state(torch.zeros(24, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 4"):
        philox_state(1, 6)


def test_resume_continues_the_stream_on_the_cpu():
    rng = PrivateRandomness.secure("cpu")
    _draws(rng)
    saved = rng.state_dict()
    assert saved["device"] == "cpu"
    first = _draws(rng)
    other = PrivateRandomness.secure("cpu")
    other.load_state_dict(saved)
    again = _draws(other)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_a_checkpoint_of_another_device_kind_is_refused():
    rng = PrivateRandomness.secure("cpu")
    state = dict(rng.state_dict(), device="cuda")
    with pytest.raises(ValueError, match="drawn by the cuda generator but this run's generators "
                                         "are on cpu.*device='cuda'"):
        rng.load_state_dict(state)
    old = {k: v for k, v in rng.state_dict().items() if k != "device"}  # before 0.4: CPU
    rng.load_state_dict(old)


def test_secure_state_is_not_derivable_from_the_seed_on_the_cpu():
    x, y = _data()
    kw = dict(noise_multiplier=1.0, epochs=1, batch_size=20, seed=7, verbose=False)
    a = dpclip.make_private(_model(), None, (x, y), **kw)
    b = dpclip.make_private(_model(), None, (x, y), **kw)
    assert not torch.equal(a.rng.noise.get_state(), b.rng.noise.get_state())
    assert not torch.equal(_draws(a.rng)[1], _draws(b.rng)[1])
    r = dpclip.make_private(_model(), None, (x, y), reproducible_noise=True, **kw)
    s = dpclip.make_private(_model(), None, (x, y), reproducible_noise=True, **kw)
    assert torch.equal(_draws(r.rng)[1], _draws(s.rng)[1])  # labelled reproducible: same stream


# ------------------------------------------------------------------------------------- CUDA

@cuda
def test_cuda_generators_are_philox_keyed_from_os_entropy():
    a, b = PrivateRandomness.secure("cuda"), PrivateRandomness.secure("cuda")
    assert a.device.type == "cuda" and a.generator_kind == "philox4x32-10"
    keys = set()
    for rng in (a, b):
        for g in (rng.sampling, rng.noise):
            seed, offset = read_philox_state(g.get_state())
            assert offset % 4 == 0 and offset < 2**62
            keys.add(seed)
    assert len(keys) == 4  # four independent 64-bit keys
    assert not torch.equal(_draws(a)[1], _draws(b)[1])
    # reproducible mode on CUDA: a function of the seed, labelled
    r, s = PrivateRandomness.reproducible(3, "cuda"), PrivateRandomness.reproducible(3, "cuda")
    assert torch.equal(_draws(r)[1], _draws(s)[1]) and not r.is_private


@cuda
def test_resume_continues_the_stream_on_cuda():
    rng = PrivateRandomness.secure("cuda")
    _draws(rng)
    saved = rng.state_dict()
    assert saved["device"] == "cuda" and saved["noise"].numel() == 16
    first = _draws(rng)
    other = PrivateRandomness.secure("cuda")
    other.load_state_dict(saved)
    again = _draws(other)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@cuda
def test_a_truncated_cuda_state_is_refused_not_restarted_at_offset_zero():
    """torch takes an 8-byte CUDA state (the seed alone) and resets the offset to 0: a resume from
    such a state would not continue the stream, so it is refused."""
    rng = PrivateRandomness.secure("cuda")
    state = rng.state_dict()
    state["noise"] = state["noise"][:8].clone()
    with pytest.raises(RuntimeError, match="expected 16 bytes"):
        rng.load_state_dict(state)


@cuda
def test_cuda_generator_is_rekeyed_before_its_offset_could_wrap():
    rng = PrivateRandomness.secure("cuda")
    key, _ = read_philox_state(rng.noise.get_state())
    rng.noise.set_state(philox_state(key, REKEY_OFFSET))
    rng.before_release()
    new_key, new_offset = read_philox_state(rng.noise.get_state())
    assert new_key != key and new_offset < 2**62


@cuda
def test_cuda_noise_is_drawn_on_the_device_in_float64():
    rng = PrivateRandomness.reproducible(5, "cuda")
    twin = PrivateRandomness.reproducible(5, "cuda")
    out = add_gaussian_noise_all({"w": torch.zeros(1000, device="cuda")}, 1.0, rng.noise)["w"]
    z = torch.randn(1000, generator=twin.noise, dtype=torch.float64, device="cuda").float()
    assert out.device.type == "cuda" and torch.equal(out, z)


@cuda
def test_make_private_on_cuda_keeps_data_masks_and_noise_on_the_gpu():
    x, y = _data()
    opt_model = _model("cuda")
    opt = torch.optim.SGD(opt_model.parameters(), lr=0.1)
    dp = dpclip.make_private(opt_model, opt, (x, y), noise_multiplier=1.0, epochs=1,
                             batch_size=20, device="cuda", verbose=False)
    assert dp._x.device.type == "cuda" and dp.rng.device.type == "cuda"
    for xb, yb in dp.loader:
        assert xb.device.type == "cuda"
        dp.step(xb, yb)
        break
    assert all(p.device.type == "cuda" for p in opt_model.parameters())
    kept = dpclip.make_private(_model("cuda"), None, (x, y), noise_multiplier=1.0, epochs=1,
                               batch_size=20, device="cuda", data_on_device=False, verbose=False)
    assert kept._x.device.type == "cpu"
    xb, _ = kept.sample()
    assert xb.device.type == "cuda"


def test_a_model_on_another_device_is_refused_before_any_step():
    """make_private does not move the model (as Opacus'): the batches go to ``device`` and the
    first step failed inside the engine ("Input type (torch.cuda.FloatTensor) and weight type
    (torch.FloatTensor) should be the same", benchmarks/step_profile.py on a GPU). Now a clear
    error at make_private naming the parameter and the fix."""
    model = _model("meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"device='cpu' but the model's parameter '0.weight' is "
                                         r"on meta; move the model first \(model.to\('cpu'\)\)"):
        dpclip.make_private(model, opt, _data(), noise_multiplier=1.0, steps=2, batch_size=20.0,
                            device="cpu", verbose=False)
    # the model on the device: accepted
    model = _model()
    dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(),
                        noise_multiplier=1.0, steps=2, batch_size=20.0, device="cpu",
                        verbose=False)
