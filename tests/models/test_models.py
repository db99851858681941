"""Model registry: shapes, parameter counts, activations, options, errors, determinism."""

import pytest
import torch
from torch import nn

import dpclip.models as models
from dpclip.models import (
    MODELS,
    ModelEntry,
    TemperedSigmoid,
    build_model,
    list_models,
    make_activation,
)

EXPECTED = {"lin-b1", "lin-b2", "lin-b3", "lin-b4", "logreg", "mlp", "papernot-cifar-cnn",
            "papernot-cnn", "transformer", "lip-convnet", "lip-small-cnn", "lip-orth-cnn",
            "tabular-mlp", "lenet5",
            "bn-lenet5",
            "nguyen-convnet", "resnet18", "scatter-linear"}
#: Nguyen et al.'s BatchNorm networks (batch clipping only); their BN-free variants by option
BN_MODELS = {"bn-lenet5": None, "nguyen-convnet": {"norm": "none"}, "resnet18": {"norm": "gn"}}
CONV_MODELS = ["papernot-cnn", "papernot-cifar-cnn", "lin-b1", "lin-b3", "lin-b4"]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def activations_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Tanh, nn.ReLU, TemperedSigmoid))]


# ------------------------------------------------------------------ tempered sigmoid
def test_tempered_sigmoid_default_is_tanh():
    x = torch.linspace(-20, 20, 4001, dtype=torch.float64)
    torch.testing.assert_close(TemperedSigmoid()(x), torch.tanh(x), rtol=0, atol=1e-14)
    x32 = torch.randn(1000) * 3
    torch.testing.assert_close(
        TemperedSigmoid(2.0, 2.0, 1.0)(x32), torch.tanh(x32), rtol=0, atol=1e-6
    )


def test_tempered_sigmoid_other_parameters():
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    torch.testing.assert_close(TemperedSigmoid(1.0, 1.0, 0.0)(x), torch.sigmoid(x))
    torch.testing.assert_close(
        TemperedSigmoid(3.0, 0.5, 1.5)(x), 3.0 * torch.sigmoid(0.5 * x) - 1.5
    )
    assert list(TemperedSigmoid().parameters()) == []


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"scale": 0.0}, "scale"),
        ({"inverse_temperature": -1.0}, "inverse_temperature"),
        ({"offset": float("nan")}, "offset"),
    ],
)
def test_tempered_sigmoid_rejects_bad_parameters(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        TemperedSigmoid(**kwargs)


# ------------------------------------------------------------------ registry
def test_registered_names():
    assert set(MODELS) == EXPECTED
    assert [e.name for e in list_models()] == sorted(EXPECTED)
    assert all(isinstance(e, ModelEntry) and e.paper and e.description for e in list_models())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_output_shape_backward_and_no_batchnorm(name):
    entry = MODELS[name]
    torch.manual_seed(0)
    model = build_model(name, entry.intended_input_shape, entry.intended_num_classes)
    if name == "transformer":  # token ids
        x = torch.randint(0, 10_000, (3, *entry.intended_input_shape))
    else:
        x = torch.randn(3, *entry.intended_input_shape)
    out = model(x)
    assert out.shape == (3, entry.intended_num_classes)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # no layer mixes examples (BatchNorm) except in Nguyen's BN networks, whose BN-free variant
    # has none; the other papers' networks have no normalization at all
    bn = (nn.modules.batchnorm._BatchNorm, nn.InstanceNorm2d)
    if name in BN_MODELS:
        assert any(isinstance(m, bn) for m in model.modules())
        if BN_MODELS[name] is None:
            return
        model = build_model(name, entry.intended_input_shape, entry.intended_num_classes,
                            **BN_MODELS[name])
        assert not any(isinstance(m, bn) for m in model.modules())
        return
    banned = bn
    if name not in ("transformer", "scatter-linear"):  # pre-LN encoder: LayerNorm is per
        # example; Tramer & Boneh's GroupNorm on the scattering coefficients too
        banned = banned + (nn.GroupNorm, nn.LayerNorm)
    assert not any(isinstance(m, banned) for m in model.modules())


def test_nguyen_models_structure():
    from dpclip.engine import ParamGroups

    bn = build_model("bn-lenet5", (1, 28, 28), 10)
    assert len(ParamGroups.per_layer(bn)) == 8  # L = 8 clipping blocks, as in the paper
    assert len(ParamGroups.per_layer(build_model("lenet5", (1, 28, 28), 10))) == 5
    bn32 = build_model("bn-lenet5", (1, 32, 32), 10)  # 32x32 inputs: no padding needed
    assert bn32(torch.randn(2, 1, 32, 32)).shape == (2, 10)
    assert bn.conv1.padding == (2, 2) and build_model("lenet5", (1, 32, 32), 10).conv1.padding \
        == (0, 0)
    r = build_model("resnet18", (3, 32, 32), 10)
    assert len(ParamGroups.per_parameter(r)) == 62  # algorithms.md A9
    assert 11_000_000 < n_params(r) < 11_300_000
    assert any(isinstance(m, nn.GroupNorm) for m in build_model(
        "resnet18", (3, 32, 32), 10, norm="gn").modules())
    with pytest.raises(ValueError, match="norm"):
        build_model("nguyen-convnet", (3, 32, 32), 10, norm="ln")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_deterministic_init_from_global_generator(name):
    entry = MODELS[name]
    torch.manual_seed(123)
    a = build_model(name, entry.intended_input_shape, 5)
    torch.manual_seed(123)
    b = build_model(name, entry.intended_input_shape, 5)
    torch.manual_seed(124)
    c = build_model(name, entry.intended_input_shape, 5)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(sa) == list(sb) == list(sc)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_papernot_cnn_structure_and_parameter_count():
    model = build_model("papernot-cnn", (1, 28, 28), 10)
    assert (
        n_params(model)
        == 26_010
        == (16 * 64 + 16) + (32 * 16 * 16 + 32) + (512 * 32 + 32) + (32 * 10 + 10)
    )
    assert [name for name, _ in model.named_children()] == [
        "conv1",
        "act1",
        "pool1",
        "conv2",
        "act2",
        "pool2",
        "flatten",
        "fc1",
        "act3",
        "fc2",
    ]
    assert (model.conv1.kernel_size, model.conv1.stride, model.conv1.padding) == (
        (8, 8),
        (2, 2),
        (3, 3),
    )
    assert (model.conv2.kernel_size, model.conv2.stride, model.conv2.padding) == (
        (4, 4),
        (2, 2),
        (0, 0),
    )
    assert isinstance(model.pool1, nn.MaxPool2d) and model.pool1.stride == 1
    assert model.fc1.in_features == 512 and model.fc1.out_features == 32
    assert all(isinstance(m, nn.Tanh) for m in activations_of(model))
    assert len(activations_of(model)) == 3


def test_lin_b1_literal_table():
    model = build_model("lin-b1", (1, 28, 28), 10)
    assert (model.conv1.kernel_size, model.conv1.stride, model.conv1.padding) == (
        (3, 3),
        (2, 2),
        (1, 1),
    )
    assert (model.conv2.kernel_size, model.conv2.stride, model.conv2.padding) == (
        (3, 3),
        (1, 1),
        (1, 1),
    )
    assert model.conv1.out_channels == 16 and model.conv2.out_channels == 32
    # 28 -> 14 -> 13 -> 13 -> 12: flatten 32 * 12 * 12
    assert model.fc1.in_features == 4608 and model.fc1.out_features == 32
    assert model.fc2.out_features == 10  # printed "FC 32" fixed to num_classes
    assert n_params(model) == 160 + 4640 + (4608 * 32 + 32) + 330


def test_lin_b3_table():
    model = build_model("lin-b3", (1, 28, 28), 10)
    assert isinstance(model.pool1, nn.AvgPool2d) and isinstance(model.pool2, nn.AvgPool2d)
    assert model.conv1.kernel_size == (5, 5) and model.conv2.kernel_size == (5, 5)
    assert model.fc1.in_features == 512 and model.fc1.out_features == 512
    assert n_params(model) == (16 * 25 + 16) + (16 * 32 * 25 + 32) + (512 * 512 + 512) + (
        512 * 10 + 10
    )
    assert all(isinstance(m, nn.Tanh) for m in activations_of(model))


def test_cifar_nets_flatten_sizes():
    assert build_model("papernot-cifar-cnn", (3, 32, 32), 10).fc1.in_features == 2048
    assert build_model("lin-b4", (3, 32, 32), 10).fc1.in_features == 1152


def test_conv_nets_accept_other_square_sizes():
    model = build_model("papernot-cnn", (3, 32, 32), 10)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert model.conv1.in_channels == 3


@pytest.mark.parametrize("name", CONV_MODELS)
def test_conv_nets_reject_flat_or_tiny_inputs(name):
    with pytest.raises(ValueError, match="channels, height, width"):
        build_model(name, (784,), 10)
    with pytest.raises(ValueError, match="too small"):
        build_model(name, (1, 4, 4), 10)


# ------------------------------------------------------------------ activation option
@pytest.mark.parametrize("name", CONV_MODELS + ["mlp"])
def test_activation_option(name):
    entry = MODELS[name]
    shape = entry.intended_input_shape
    relu = build_model(name, shape, 10, activation="relu")
    assert activations_of(relu) and all(isinstance(m, nn.ReLU) for m in activations_of(relu))
    tempered = build_model(
        name,
        shape,
        10,
        activation="tempered-sigmoid",
        scale=3.0,
        inverse_temperature="0.5",
        offset=1,
    )
    acts = activations_of(tempered)
    assert acts and all(isinstance(m, TemperedSigmoid) for m in acts)
    assert (acts[0].scale, acts[0].inverse_temperature, acts[0].offset) == (3.0, 0.5, 1.0)
    # same weights, different activation -> different function
    torch.manual_seed(0)
    a = build_model(name, shape, 10)
    torch.manual_seed(0)
    b = build_model(name, shape, 10, activation="relu")
    x = torch.randn(2, *shape)
    assert not torch.allclose(a(x), b(x))


def test_tempered_sigmoid_defaults_reproduce_tanh_model():
    torch.manual_seed(0)
    a = build_model("papernot-cnn", (1, 28, 28), 10)
    torch.manual_seed(0)
    b = build_model("papernot-cnn", (1, 28, 28), 10, activation="tempered-sigmoid")
    x = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-6)


def test_tempered_parameters_need_tempered_activation():
    with pytest.raises(ValueError, match="scale.*tempered-sigmoid"):
        build_model("papernot-cnn", (1, 28, 28), 10, scale=3.0)


def test_unknown_activation_lists_valid_ones():
    with pytest.raises(ValueError) as info:
        build_model("lin-b3", (1, 28, 28), 10, activation="gelu")
    for valid in ("relu", "tanh", "tempered-sigmoid"):
        assert valid in str(info.value)
    with pytest.raises(ValueError, match="valid activations"):
        make_activation("swish")


# ------------------------------------------------------------------ options and errors
def test_unknown_model_lists_valid_names():
    with pytest.raises(ValueError) as info:
        build_model("resnet-1000", (1, 28, 28), 10)
    assert "resnet-1000" in str(info.value)
    for name in EXPECTED:
        assert name in str(info.value)


def test_unknown_option_names_it_and_the_valid_ones():
    with pytest.raises(ValueError) as info:
        build_model("mlp", (30,), 2, hiden=(8,))
    message = str(info.value)
    assert "hiden" in message and "hidden" in message and "activation" in message
    with pytest.raises(ValueError, match=r"no option\(s\) activation; valid options: \(none\)"):
        build_model("logreg", (30,), 2, activation="relu")


def test_mlp_hidden_option():
    model = build_model("mlp", (3, 4), 5, hidden="16,8")  # CLI string
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(12, 16), (16, 8), (8, 5)]
    assert model(torch.randn(2, 3, 4)).shape == (2, 5)
    default = build_model("mlp", (30,), 2)
    assert [m.out_features for m in default.modules() if isinstance(m, nn.Linear)] == [64, 64, 2]
    flat = build_model("mlp", (30,), 2, hidden=())
    assert [m.out_features for m in flat.modules() if isinstance(m, nn.Linear)] == [2]
    with pytest.raises(ValueError, match="hidden"):
        build_model("mlp", (30,), 2, hidden=(8, 0))
    with pytest.raises(ValueError, match="hidden"):
        build_model("mlp", (30,), 2, hidden=8)


def test_logreg_is_one_linear():
    model = build_model("logreg", (1, 8, 8), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 1 and linears[0].in_features == 64
    assert not activations_of(model)


@pytest.mark.parametrize("bad", [(), (0, 28), (1, -28, 28), [1.5]])
def test_bad_input_shape(bad):
    with pytest.raises(ValueError, match="input_shape"):
        build_model("mlp", bad, 10)


@pytest.mark.parametrize("bad", [1, 0, 2.5, True])
def test_bad_num_classes(bad):
    with pytest.raises(ValueError, match="num_classes"):
        build_model("logreg", (4,), bad)


def test_bad_numeric_option_value_is_named():
    with pytest.raises(ValueError, match="scale='big'"):
        build_model("mlp", (4,), 2, activation="tempered-sigmoid", scale="big")


def test_curated_all():
    assert len(set(models.__all__)) == len(models.__all__)
    for name in models.__all__:
        assert hasattr(models, name), name
    for required in ("MODELS", "TemperedSigmoid", "build_model", "list_models"):
        assert required in models.__all__
