"""Hundred-and-fifteenth hostile review: state inside a plain Python object the model holds. A
transformers ``DynamicCache`` made in ``__init__`` and passed as ``past_key_values`` with
``use_cache=True`` appended every call's keys and values to its layers' tensors; the next step's
attention read them. The state guard sees tensors in a module's ``__dict__`` and the chunk
isolation compared an object attribute by identity only, so under vmap (and auto's vmap
fallback) a removed example of step 1 moved step 2's release by 2.59 C. Now an object held by a
module (or by a container it holds) is compared by its attributes, at every depth, like a
container (``isolation._object_parts``): the step is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError


class _Memory:
    """A plain object: a list of tensors inside it, appended by every call."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []


class _Slotted:
    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = None


class _Net(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3).double()
        self.where = where
        self.box = _Memory() if where == "object" else _Slotted()
        self.held = [_Memory()]  # (an object inside a container)

    def forward(self, x):
        out = self.fc(x)
        if self.where == "object":
            if self.box.kept:
                out = out * self.box.kept[-1].sum()
            self.box.kept.append(x.detach().sum(0))
        elif self.where == "slot":
            if self.box.last is not None:
                out = out * self.box.last.sum()
            self.box.last = x.detach().sum(0)
        else:  # "in-list"
            if self.held[0].kept:
                out = out * self.held[0].kept[-1].sum()
            self.held[0].kept.append(x.detach().sum(0))
        return out


def _loss(o, y):
    return nn.functional.cross_entropy(o, y, reduction="none")


@pytest.mark.parametrize("engine", ["vmap", "naive"])
@pytest.mark.parametrize("where", ["object", "slot", "in-list"])
def test_state_kept_inside_an_object_is_refused(engine, where):
    torch.manual_seed(1)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    model = _Net(where)
    eng = get_engine(engine)
    with pytest.raises((UnsupportedModelError, RuntimeError)):
        for _ in range(2):
            eng.compute(model, _loss, x, y, lambda n: torch.clamp(1.0 / n, max=1.0),
                        ParamGroups.flat(model))


def test_a_transformers_cache_kept_on_the_model_is_refused_under_vmap():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=64,
                                   attn_implementation="eager")

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.m = transformers.LlamaForCausalLM(cfg).double().eval()
            self.cache = transformers.DynamicCache(config=cfg)

        def forward(self, ids):
            out = self.m(input_ids=ids, past_key_values=self.cache, use_cache=True)
            return out.logits.mean(1)

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 30, (4, 4), generator=g)
    y = torch.randint(0, 30, (4,), generator=g)
    model = Wrap()
    with pytest.raises((UnsupportedModelError, RuntimeError)):
        for _ in range(2):
            get_engine("vmap").compute(model, _loss, ids, y,
                                       lambda n: torch.clamp(1e-3 / n, max=1.0),
                                       ParamGroups.flat(model))


class _Builtins(nn.Module):
    """A value of one example kept in a mutable builtin attribute (naive runs the examples one
    by one: the next example reads it)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import array
        import collections

        import numpy as np

        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3).double()
        self.kind = kind
        self.store = {"deque": collections.deque([1.0]), "bytearray": bytearray(b"\x01"),
                      "array": array.array("d", [1.0]), "ndarray": np.ones(1)}[kind]

    def forward(self, x):
        sign = 1.0 if float(x[0, 0]) >= 0 else -1.0
        if self.kind == "deque":
            k = self.store[-1]
            self.store.append(sign)
        elif self.kind == "bytearray":
            k = 1.0 if self.store[0] == 1 else -1.0
            self.store[0] = 1 if sign > 0 else 2
        else:
            k = float(self.store[0])
            self.store[0] = sign
        return self.fc(x) * k


@pytest.mark.parametrize("kind", ["deque", "bytearray", "array", "ndarray"])
def test_a_value_kept_in_a_mutable_builtin_attribute_is_refused(kind):
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    x[0, 0] = -1.0
    model = _Builtins(kind)
    with pytest.raises(UnsupportedModelError, match="attribute 'store'"):
        get_engine("naive", max_physical_batch=1).compute(  # (one example a chunk)
            model, _loss, x, y, lambda n: torch.clamp(1.0 / n, max=1.0), ParamGroups.flat(model))
