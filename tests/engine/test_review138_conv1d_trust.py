"""Hundred-and-thirty-eighth hostile review: the ghost engine runs a ruled layer's forward
untraced, as library code. transformers' Conv1D was recognised by reading
``transformers.pytorch_utils.Conv1D`` and its forward trusted by its FILE: any top-level package
in a folder named ``site-packages`` counted as a library. A forward a package there put on the
real class (``Conv1D.forward = lib.forward``, as an adapter library might at import), a class put
in the module's attribute, or a function whose ``co_filename`` was rewritten, added 10 x the
batch's sum to every row before the product, unseen by the proof: LOO 13.47 C under ghost, auto
and ``make_private``. Now only transformers' own class counts, its forward the function its
source file defines (the code compared with what the file compiles to)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

pu = pytest.importorskip("transformers.pytorch_utils")

from dpclip.engine import get_engine  # noqa: E402
from dpclip.engine.errors import UnsupportedModelError  # noqa: E402
from dpclip.engine.library_code import hf_conv1d  # noqa: E402
from tests.engine.helpers import loo_distance  # noqa: E402

DT = torch.float64
_REAL_CLASS, _REAL_FORWARD = pu.Conv1D, pu.Conv1D.__dict__["forward"]

_SOURCE = textwrap.dedent('''
    import torch
    from torch import nn


    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        h = x.view(-1, x.size(-1))
        h = h + h.sum(0, keepdim=True) * 10.0  # every row + 10 x the batch's sum
        x = torch.addmm(self.bias, h, self.weight)
        return x.view(size_out)


    class Conv1D(nn.Module):
        def __init__(self, nf, nx):
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.empty(nx, nf))
            self.bias = nn.Parameter(torch.zeros(nf))

        forward = forward
''')


@pytest.fixture
def mixing(tmp_path):
    """A package in a folder named site-packages (as every pip-installed library's)."""
    pkg = tmp_path / "site-packages" / "mixconv_r138"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_SOURCE)
    sys.path.insert(0, str(tmp_path / "site-packages"))
    try:
        import mixconv_r138

        yield mixconv_r138
    finally:
        sys.path.remove(str(tmp_path / "site-packages"))
        sys.modules.pop("mixconv_r138", None)
        pu.Conv1D = _REAL_CLASS
        _REAL_CLASS.forward = _REAL_FORWARD


def _make():
    m = pu.Conv1D(2, 2).to(DT)
    with torch.no_grad():
        m.weight.copy_(torch.eye(2, dtype=DT))
        m.bias.zero_()
    return nn.Sequential(m)


def _loss(o, t):
    return 0.5 * o[:, 0] ** 2


def _loo(name):
    x = torch.ones(8, 2, dtype=DT)
    x[3, 0] = -64.0  # the target: flips the sign of every row's mixed output
    y = torch.zeros(8, dtype=torch.long)
    try:
        return loo_distance(lambda: get_engine(name), _make, x, y, 1.0, loss=_loss, exact=True)
    except UnsupportedModelError:
        return 0.0  # refused: sound


def _forged(fn, filename):
    return type(fn)(fn.__code__.replace(co_filename=filename, co_qualname="Conv1D.forward",
                                        co_firstlineno=_REAL_FORWARD.__code__.co_firstlineno),
                    vars(pu), "forward")


@pytest.mark.parametrize("how", ["forward-from-site-packages", "class-from-site-packages",
                                 "forged-file-name"])
@pytest.mark.parametrize("name", ["ghost", "auto"])
def test_a_replaced_conv1d_is_not_run_as_library_code(mixing, how, name):
    if how == "forward-from-site-packages":
        _REAL_CLASS.forward = mixing.forward
    elif how == "class-from-site-packages":
        pu.Conv1D = mixing.Conv1D
    else:  # its code claims transformers' file, qualified name and line, in its globals
        _REAL_CLASS.forward = _forged(mixing.forward, _REAL_FORWARD.__code__.co_filename)
    assert hf_conv1d() is None
    assert _loo(name) <= 1.0 + 1e-9  # (before: 13.47 C)


def test_transformers_own_conv1d_keeps_its_rule(mixing):
    assert hf_conv1d() is _REAL_CLASS
    res = get_engine("ghost").compute(_make(), _loss, torch.randn(8, 2, dtype=DT),
                                      torch.zeros(8, dtype=torch.long), lambda n: n * 0 + 1,
                                      __import__("dpclip.engine", fromlist=["ParamGroups"])
                                      .ParamGroups.flat(_make()))
    assert not (res.engine_info or {}).get("per_layer")  # the Conv1D rule, not the per-layer path
    _REAL_CLASS.forward = mixing.forward
    assert hf_conv1d() is None
    _REAL_CLASS.forward = _REAL_FORWARD
    assert hf_conv1d() is _REAL_CLASS  # (the verdict follows the class back)
