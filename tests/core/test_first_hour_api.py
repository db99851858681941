"""The API as a new user meets it (issue 35): make_private's signature and batch size, labels and
arrays checked before the first step, did-you-mean, messages naming Python arguments,
check_model / fix_model."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import DeprecatedSpellingWarning
from dpclip.training.private import PrivateTraining, make_private


def _data(n=128, d=6, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, k, generator=g)).argmax(1)
    return x, y


def _model(d=6, k=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, k))


BASE = dict(noise_multiplier=1.0, epochs=1, delta=1e-5, reproducible_noise=True)


def test_make_private_signature_lists_every_parameter():
    """help(make_private) and IDE completion see every parameter (no **kwargs), and every
    parameter of PrivateTraining a user sets is there, documented in the docstring."""
    sig = inspect.signature(make_private)
    assert not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    wanted = set(inspect.signature(PrivateTraining.__init__).parameters) - {"self", "flags"}
    assert wanted <= set(sig.parameters)
    doc = make_private.__doc__ or ""
    for name in wanted - {"model", "optimizer", "data"}:
        assert f"{name}:" in doc, name


def test_batch_size_comes_from_the_dataloader_and_is_said(capsys):
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    dp = make_private(_model(), None, loader, **BASE)
    assert dp.sampler.expected_batch_size == 16
    assert "batch_size = 16 (the DataLoader's" in capsys.readouterr().err
    dp = make_private(_model(), None, loader, batch_size=32, **BASE)
    assert dp.sampler.expected_batch_size == 32
    assert "DataLoader's batch_size 16 is not used" in capsys.readouterr().err


def test_batch_size_missing_is_an_error_not_256():
    x, y = _data()
    with pytest.raises(ValueError, match=r"make_private: batch_size is required \(data is "
                                         r"tuple\): pass batch_size="):
        make_private(_model(), None, (x, y), **BASE)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="uses a batch_sampler"):
        make_private(_model(), None, loader, **BASE)


# -- labels and arrays, checked before the first step --------------------------------------------

def test_float_labels_are_refused_before_the_first_step():
    x, y = _data()
    with pytest.raises(ValueError, match=r"make_private: targets have dtype float32; the default "
                                         r"loss \(cross-entropy\) needs integer class indices "
                                         r"0..C-1; convert them with targets.long\(\)"):
        make_private(_model(), None, (x, y.float()), batch_size=32, **BASE)
    with pytest.raises(ValueError, match="for regression pass loss_fn="):
        make_private(_model(), None, (x, torch.rand(len(x))), batch_size=32, **BASE)


def test_out_of_range_labels_are_refused_before_the_first_step():
    x, y = _data()
    y = y.clone()
    y[:5] = 3  # the model has 3 outputs: 0..2
    with pytest.raises(ValueError, match=r"make_private: some of the targets are outside 0..2 "
                                         r"\(the model has 3 outputs\); map the labels"):
        make_private(_model(), None, (x, y), batch_size=32, **BASE)
    y[:5] = -1
    with pytest.raises(ValueError, match="some of the targets are outside 0..2") as got:
        make_private(_model(), None, (x, y), batch_size=32, **BASE)
    assert "5" not in str(got.value)  # (how many private labels are bad: not published)


def test_numpy_arrays_are_converted_and_said_once(capsys):
    np = pytest.importorskip("numpy")
    x, y = _data()
    dp = make_private(_model(), None, (x.double().numpy(), y.numpy()), batch_size=32, **BASE)
    err = capsys.readouterr().err
    assert err.count("converted numpy arrays") == 1
    assert "inputs float64 -> float32; targets int64 -> int64" in err
    xb, yb = dp.sample()
    assert xb.dtype == torch.float32 and yb.dtype == torch.int64
    dp.backward(xb, yb)
    assert dp.steps == 1


def test_string_labels_get_a_relevant_message():
    np = pytest.importorskip("numpy")
    x, _ = _data()
    for labels, what in ((np.array(["cat", "dog"] * 64), "numpy dtype <U3"),
                         (["cat", "dog"] * 64, "a list of str")):
        with pytest.raises(ValueError) as info:
            make_private(_model(), None, (x, labels), batch_size=32, **BASE)
        msg = str(info.value)
        assert msg.startswith(f"make_private: targets are strings ({what}); the default loss")
        assert "numpy.unique(labels, return_inverse=True)" in msg
        assert "public configuration" not in msg


def test_strategy_names_get_did_you_mean_in_the_api():
    x, y = _data()
    with pytest.raises(ValueError, match=r"unknown strategy 'quantil' \(did you mean "
                                         r"'quantile'\?\); valid strategies: "):
        make_private(_model(), None, (x, y), batch_size=32, strategy="quantil", **BASE)


# -- check_model / fix_model ---------------------------------------------------------------------

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 48, 3)
        self.bn = nn.BatchNorm2d(48)
        self.act = nn.PReLU()
        self.register_buffer("scale", torch.ones(1))
        self.head = nn.Linear(48, 3)

    def forward(self, x):
        return self.head(self.act(self.bn(self.conv(x))).mean((2, 3)) * self.scale)


def test_check_model_lists_every_problem_and_fix_model_fixes_batchnorm(capsys):
    model = _Net()
    report = dpclip.check_model(model, strategy="fixed")
    kinds = {(p.layer, p.kind) for p in report.problems}
    assert kinds == {("bn", "batchnorm"), ("scale", "buffer"), ("act", "ghost")}
    assert not report.ok and "training refuses this model" in str(report)
    ghost = next(p for p in report.problems if p.kind == "ghost")
    assert "per-layer path (per-example gradients of its own 1 parameters" in ghost.message
    assert not ghost.blocking
    # batch clipping allows BatchNorm
    assert "batchnorm" not in {p.kind for p in dpclip.check_model(model, unit="bc").problems}
    with pytest.warns(DeprecatedSpellingWarning, match="unit='bc'"):  # the old spelling, still read
        assert "batchnorm" not in {p.kind for p in dpclip.check_model(
            model, strategy_params={"unit": "bc"}).problems}
    # a materialising strategy says what it costs
    ada = dpclip.check_model(nn.Linear(4, 2), strategy="adaclip")
    assert [p.kind for p in ada.problems] == ["strategy"] and "all 10 trainable" in str(ada)
    with pytest.raises(ValueError, match="did you mean 'quantile'"):
        dpclip.check_model(model, strategy="quantil")

    fixed = dpclip.fix_model(model)
    assert fixed is model and isinstance(model.bn, nn.GroupNorm)
    assert (model.bn.num_groups, model.bn.num_channels) == (16, 48)  # gcd(32, 48)
    assert "bn (BatchNorm2d -> GroupNorm(16, 48))" in capsys.readouterr().err
    assert "batchnorm" not in {p.kind for p in dpclip.check_model(model).problems}
    assert dpclip.check_model(nn.Sequential(nn.Linear(4, 2))).ok


def test_auto_fallback_is_said_once_naming_the_layer():
    from dpclip.errors import DeprecatedSpellingWarning, EngineFallbackWarning

    torch.manual_seed(0)
    # an Embedding with scale_grad_by_freq (its gradient depends on the batch's token counts) is
    # refused by the ghost engine's static checks, so auto runs the model on vmap
    model = nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Flatten(),
                          nn.Linear(12, 3))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 10, (128, 3), generator=g)
    y = torch.randint(0, 3, (128,), generator=g)
    dp = make_private(model, None, (x, y), batch_size=32, engine="auto", **BASE)
    with pytest.warns(EngineFallbackWarning, match=r"engine 'auto' ran on 'vmap': unsupported "
                                                   r"layer\(s\): '0' \(Embedding"):
        for _ in range(2):
            xb, yb = dp.sample()
            dp.backward(xb, yb)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)  # not again for the same reason
        xb, yb = dp.sample()
        dp.backward(xb, yb)


def test_api_messages_name_the_python_argument():
    x, y = _data()
    with pytest.raises(ValueError, match=r"lower batch_size \(CLI --batch-size\)"):
        make_private(_model(), None, (x, y), batch_size=1000, **BASE)
    with pytest.raises(ValueError, match=r"unit=gbc needs sampling='fixed-size' \(CLI"):
        make_private(_model(), None, (x, y), batch_size=32, unit="gbc", miniset_size=4, **BASE)
    with pytest.raises(ValueError, match=r"\(miniset_size=S; CLI --miniset-size S\)"):
        make_private(_model(), None, (x, y), batch_size=32, unit="gbc",
                     sampling="fixed-size", **BASE)


def test_the_label_check_never_feeds_private_data_to_the_model():
    """The number of outputs comes from an all-zero input: no private value reaches the model
    (or a buffer it might update) before the first accounted step."""
    seen = []

    class Spy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x):
            seen.append(x.detach().clone())
            return self.lin(x)

    x, y = _data()
    make_private(Spy(), None, (x + 5.0, y), batch_size=32, **BASE)
    assert len(seen) == 1 and torch.count_nonzero(seen[0]) == 0
