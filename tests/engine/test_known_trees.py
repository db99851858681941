"""Known trees: dpclip's own model classes whose ``forward`` composes known modules
(``TextTransformer``, ``TransformerEncoderLayer``, ``SelfAttention``) are proved by their code,
like a chain of known ``torch.nn`` modules: no trace, no memory watch, no fingerprints
(``ghost_forward._known_tree``). Only the exact classes with the forwards dpclip's files define,
plain instances with the declared children and configuration, no hooks, and torch's own functions
under the names the forwards use: anything else is traced as user code, and a variant that mixes
the examples is then refused (each attack below).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from dpclip.engine import naive_per_example_grads, separable
from dpclip.engine.known_losses import cross_entropy_per_example as known_ce
from dpclip.models.architectures import SelfAttention, TextTransformer
from tests.engine.helpers import DT, assert_grads_close, clip_weights, oracle_norms, oracle_sum

C = 0.5


def _model() -> TextTransformer:
    torch.manual_seed(0)
    return TextTransformer(50, 8, 3, d_model=16, heads=2, layers=2, ff=32).to(DT)


def _data(b: int = 6):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (b, 8), generator=g), torch.randint(0, 3, (b,), generator=g)


def _traced_ops(monkeypatch) -> list[str]:
    seen: list[str] = []
    orig = separable.SeparabilityTracer.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(func._schema.name)
        return orig(self, func, types, args, kwargs)

    monkeypatch.setattr(separable.SeparabilityTracer, "__torch_dispatch__", spy)
    return seen


def _run(engine, model, x, y):
    groups = ParamGroups.flat(model)
    return engine().compute(model, known_ce, x, y, clip_weights(C), groups), groups


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_the_text_transformer_is_proved_by_its_code_and_equals_the_loop(engine, monkeypatch):
    seen = _traced_ops(monkeypatch)
    model = _model()
    for b in (6, 5):  # (a new batch size: still no trace)
        x, y = _data(b)
        res, groups = _run(engine, model, x, y)
        assert res.engine_info["engine"] == "ghost", res.engine_info
        per_ex = naive_per_example_grads(model, known_ce, x, y)
        torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, b), rtol=1e-10,
                                   atol=1e-12)
        assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, b))
    assert not seen, seen[:5]


def _mixing_forward(self, x: Tensor) -> Tensor:  # attention over the batch: every example's
    b, t, d = x.shape                             # keys and values to every other's queries
    q, k, v = self.qkv(x).chunk(3, -1)
    scores = q.reshape(b * t, d) @ k.reshape(b * t, d).T
    return self.out((scores.softmax(-1) @ v.reshape(b * t, d)).reshape(b, t, d))


class _Sub(SelfAttention):
    forward = _mixing_forward


def _patched_class(model):
    original = SelfAttention.forward
    SelfAttention.forward = _mixing_forward
    return lambda: setattr(SelfAttention, "forward", original)


def _subclass(model):
    for layer in model.layers:
        old = layer.attn
        new = _Sub(16, 2).to(DT)
        new.load_state_dict(old.state_dict())
        layer.attn = new
    return lambda: None


def _instance_forward(model):
    for layer in model.layers:
        layer.attn.forward = _mixing_forward.__get__(layer.attn)
    return lambda: None


def _swapped_child(model):
    model.layers[0].act = nn.Softmax(dim=0)  # over the batch
    return lambda: None


def _foreign_child(model):
    class _Mean(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x + x.mean(0, keepdim=True)

    model.layers[1].norm2 = nn.Sequential(model.layers[1].norm2, _Mean())
    return lambda: None


def _extra_layer(model):
    class _Mix(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x + x.flip(0)

    model.layers.append(_Mix())
    return lambda: None


def _hook(model):
    model.layers[0].register_forward_hook(lambda m, i, o: o + o.mean(0, keepdim=True))
    return lambda: None


def _replaced_arange(model):
    original = torch.arange

    def arange(*args, **kwargs):  # positions that tell the batch size
        out = original(*args, **kwargs)
        return out * 0 + (len(_CALLS) % 2)

    _CALLS.append(1)
    torch.arange = arange
    return lambda: setattr(torch, "arange", original)


_CALLS: list[int] = []


@pytest.mark.parametrize("attack", [_patched_class, _subclass, _instance_forward, _swapped_child,
                                    _foreign_child, _extra_layer, _hook],
                         ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_changed_tree_is_traced_and_a_mixing_one_refused(engine, attack, monkeypatch):
    seen = _traced_ops(monkeypatch)
    x, y = _data()
    model = _model()
    undo = attack(model)
    try:
        try:
            res, _ = _run(engine, model, x, y)
        except UnsupportedModelError:
            assert seen  # refused by the trace (or by the proof run under it)
            return
        assert seen, "not traced"
        assert res.engine_info["engine"] == "vmap", res.engine_info  # auto: the sound fallback
    finally:
        undo()


@pytest.mark.parametrize("what", ["heads-float", "seq_len-str", "training-int"])
def test_a_configuration_of_another_type_is_not_known(what, monkeypatch):
    from dpclip.engine import ghost_forward

    model = _model()
    assert ghost_forward._known_tree(model) is not None
    if what == "heads-float":
        model.layers[0].attn.heads = 2.0
    elif what == "seq_len-str":
        model.seq_len = "8"
    else:
        model.layers[1].training = 1
    assert ghost_forward._known_tree(model) is None


def test_a_user_class_declaring_a_program_is_not_known():
    from dpclip.engine import ghost_forward

    class Mine(nn.Module):
        KNOWN_PROGRAM = {"children": {"fc": nn.Linear}}

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x - x.mean(0))

    assert ghost_forward._known_tree(Mine()) is None


def test_a_replaced_torch_function_is_not_trusted():
    from dpclip.engine import ghost_forward

    model = _model()
    undo = _replaced_arange(model)
    try:
        assert ghost_forward._known_tree(model) is None
    finally:
        undo()
    assert ghost_forward._known_tree(model) is not None


def test_a_user_class_claiming_dpclips_file_is_not_known():
    """Twenty-ninth review: a user class declaring a program, its forward's code object given
    dpclip's file name (``co_filename``), was trusted: LOO 5.98 C. Trust is by identity now
    (dpclip.registry.KNOWN_PROGRAMS)."""
    import dpclip.models.architectures as arch
    from dpclip.engine import ghost_forward

    class Evil(nn.Module):
        KNOWN_PROGRAM = {"children": {"fc": nn.Linear}}

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x + 20 * x.sum(0))

    Evil.forward.__code__ = Evil.forward.__code__.replace(co_filename=arch.__file__)
    assert ghost_forward._known_tree(Evil()) is None


@pytest.mark.parametrize("what", ["tensor", "module-list"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_replaced_iteration_is_not_trusted(engine, what, monkeypatch):
    """Twenty-ninth review: ``q, k, v = t`` runs ``Tensor.__iter__`` and ``for layer in
    self.layers`` ``ModuleList.__iter__``; replaced (mixing the batch, or yielding an extra
    mixing module), the tree ran untraced: LOO 1.51 / 1.18 C. Now those lookups are watched."""
    from dpclip.engine import ghost_forward

    if what == "tensor":
        original = torch.Tensor.__iter__

        def mixing(self):
            return original(self + 20 * self.sum(1, keepdim=True)) if self.ndim == 5 \
                else original(self)

        monkeypatch.setattr(torch.Tensor, "__iter__", mixing)
    else:
        original = nn.ModuleList.__iter__

        class _Mix(nn.Module):
            def forward(self, x: Tensor) -> Tensor:
                return x + x.flip(0)

        extra = _Mix()
        monkeypatch.setattr(nn.ModuleList, "__iter__",
                            lambda self: iter(list(original(self)) + [extra]))
    model = _model()
    assert ghost_forward._known_tree(model) is None
    x, y = _data()
    try:
        res, _ = _run(engine, model, x, y)
    except UnsupportedModelError:
        return
    assert res.engine_info["engine"] == "vmap", res.engine_info


def test_a_block_used_twice_runs_on_ghost_equal_to_the_loop():
    """Twenty-ninth review (usability): one block twice in ``layers`` was refused (its calls
    recorded once per occurrence of the module)."""
    model = _model()
    model.layers[1] = model.layers[0]
    x, y = _data()
    res, groups = _run(GhostEngine, model, x, y)
    per_ex = naive_per_example_grads(model, known_ce, x, y)
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, 6), rtol=1e-10, atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, 6))
