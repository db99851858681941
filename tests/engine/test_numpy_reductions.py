"""The ghost engine's two CPU reductions computed by numpy under torch's portable kernels
(``dpclip.blas_mode``): the float64 inner products of Gram matrices (``ghost_rules._dot64``) and
the flush of tiny entries (``ghost._shrink``). Oracles: ``math.fsum`` (the exactly rounded sum of
the exact float64 products) and torch's own ``hardshrink``."""

from __future__ import annotations

import math

import pytest
import torch

from dpclip.engine import ghost
from dpclip.engine.ghost_rules import _dot64, _gam64, _scaled


def _rows(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over many binades, signs mixed: a sum with cancellation
    x = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 20, (n, k), generator=g))
    y = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 20, (n, k), generator=g))
    return x, y


@pytest.mark.parametrize("k", [1, 7, 100, 4096, 10_000])
def test_dot64_within_the_float64_bound_of_the_exact_sum(k):
    x, y = _rows(9, k)
    got = _dot64(x, y)
    assert got.dtype == torch.float64 and got.shape == (9,)
    for i in range(9):
        terms = [float(a) * float(b) for a, b in zip(x[i].tolist(), y[i].tolist())]  # exact
        exact = math.fsum(terms)
        scale = math.fsum(abs(t) for t in terms)
        assert abs(float(got[i]) - exact) <= _gam64(k) * scale, (i, float(got[i]), exact)


@pytest.mark.parametrize("k", [100, 4096, 8193, 9999, 20_000])
def test_dot64_of_a_row_does_not_depend_on_the_other_rows(k):
    """einsum splits a row longer than numpy's buffer where the buffer ends (k 8193: 8 of 24
    rows changed with their position, k 9999: all): _dot64 takes one dot product per row, so a
    row has the same bits in a batch of 1, 5, 33 or 200 rows, at any position."""
    x, y = _rows(200 if k <= 4096 else 40, k, seed=1)
    whole = _dot64(x, y)
    n = x.shape[0]
    for lo, hi in ((0, 1), (3, 8), (n - 33, n - 2), (n - 1, n), (17, n)):
        part = _dot64(x[lo:hi], y[lo:hi])
        assert torch.equal(part, whole[lo:hi]), (lo, hi)


def test_dot64_equals_torch_float64_within_the_bound_on_gram_shapes():
    x, y = _rows(64, 64 * 64, seed=2)
    a = _dot64(x, y)
    b = torch.linalg.vecdot(x.double(), y.double())
    scale = torch.linalg.vecdot(x.double().abs(), y.double().abs())
    assert ((a - b).abs() <= 2 * _gam64(64 * 64) * scale).all()


def test_dot64_off_the_cpu_path_keeps_torch():
    x, y = _rows(4, 10)
    got = _dot64(x.double(), y.double())  # float64 rows: torch's vecdot
    torch.testing.assert_close(got, torch.linalg.vecdot(x.double(), y.double()), rtol=0, atol=0)


def _tiny_mix(dtype: torch.dtype) -> torch.Tensor:
    thr = ghost._FLUSH[dtype]
    vals = [0.0, -0.0, thr, -thr, thr * 2, -thr * 2, thr / 2, 1.0, -3.5, math.inf, -math.inf,
            math.nan, 1e-30 if dtype == torch.float32 else 1e-200, 5e-13]
    g = torch.Generator().manual_seed(0)
    base = torch.tensor(vals, dtype=dtype)
    return base[torch.randint(0, len(vals), (37, 29), generator=g)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shrink_is_hardshrink(dtype):
    was = ghost._SCALAR_KERNELS[0]
    ghost._SCALAR_KERNELS[0] = True  # (the numpy path)
    try:
        _check_shrink(dtype)
    finally:
        ghost._SCALAR_KERNELS[0] = was


def _check_shrink(dtype: torch.dtype) -> None:
    t = _tiny_mix(dtype)
    thr = ghost._FLUSH[dtype]
    want = torch.nn.functional.hardshrink(t, thr)
    got = ghost._shrink(t, thr)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # a strided view: the same
    torch.testing.assert_close(ghost._shrink(t.t(), thr), want.t(), rtol=0, atol=0,
                               equal_nan=True)
    # in place: the tensor itself, its version counted up as torch's in-place writes do
    u = t.clone()
    v0 = u._version
    out = ghost._shrink(u, thr, out=u)
    assert out is u and u._version > v0
    torch.testing.assert_close(u, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(t.isnan(), _tiny_mix(dtype).isnan())  # the input untouched


def test_shrink_uses_numpy_under_the_portable_kernels(monkeypatch):
    if not ghost._SCALAR_KERNELS[0]:
        pytest.skip("torch's vector CPU kernels are on (DPCLIP_CPU_KERNELS=native)")
    calls = []
    real = ghost._NP_MUL

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ghost, "_NP_MUL", spy)
    t = _tiny_mix(torch.float32)
    got = ghost._shrink(t, ghost._FLUSH[torch.float32])
    assert calls
    torch.testing.assert_close(got, torch.nn.functional.hardshrink(t, ghost._FLUSH[torch.float32]),
                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scaled_is_torchs_product_bit_for_bit(dtype):
    """The weights' scaling of a layer's rows (``ghost_rules._scaled``, numpy on the CPU): the
    same bits as torch's ``x * w`` (a correctly rounded product), subnormals, overflow, inf and
    NaN included, broadcast and on a strided view."""
    g = torch.Generator().manual_seed(3)
    fin = torch.finfo(dtype)
    x = torch.randn(33, 7, 5, generator=g, dtype=dtype) * torch.exp2(
        torch.randint(-160, 160, (33, 7, 5), generator=g).to(dtype))
    x.view(-1)[:6] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, fin.tiny / 4],
                                  dtype=dtype)
    w = torch.rand(33, generator=g, dtype=dtype)
    w[:3] = torch.tensor([0.0, 1.0, fin.tiny], dtype=dtype)
    ints = torch.int32 if dtype == torch.float32 else torch.int64

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(ints).masked_fill(t.isnan().contiguous(), 0)

    for xs, ws in ((x, w.view(-1, 1, 1)), (x.transpose(1, 2), w.view(-1, 1, 1)),
                   (x[:, 0], w.view(-1, 1)), (x.flatten(1), w.view(-1, 1))):
        got = _scaled(xs, ws)
        want = xs * ws
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(bits(got), bits(want))
        assert torch.equal(got.isnan(), want.isnan())


def test_dot64_in_blocks_equals_the_whole_float64_copy_bit_for_bit(monkeypatch):
    """Rows x width above ``_DOT_BLOCK_NUMEL`` go through two cached float64 buffers block by
    block (a partial last block, a strided input): every row the same bits as one ``vecdot`` of
    the whole float64 copies (the path below the threshold)."""
    import numpy as np

    from dpclip.engine import ghost_rules

    x, y = _rows(150, 4096, seed=4)  # 64 rows a block: 64, 64, 22
    assert 150 * 4096 > ghost_rules._DOT_BLOCK_NUMEL
    for xs, ys in ((x, y), (x.t().contiguous().t(), y)):  # (a column-major x: strided rows)
        want = np.vecdot(np.ascontiguousarray(xs.numpy(), dtype=np.float64),
                         np.ascontiguousarray(ys.numpy(), dtype=np.float64))
        got = _dot64(xs, ys)
        assert got.dtype == torch.float64
        assert torch.equal(got, torch.from_numpy(want))
    # blocks of 7 rows: the same bits again
    whole = _dot64(x, y)
    monkeypatch.setattr(ghost_rules, "_DOT_BLOCK_NUMEL", 7 * 4096)
    assert torch.equal(_dot64(x, y), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shrink_in_blocks_is_hardshrink(dtype, monkeypatch):
    """Above ``_SHRINK_BLOCK`` entries a contiguous tensor is flushed block by block through
    cached buffers: the same values as torch's hardshrink, tiny entries, signed zeros, infinities
    and NaN at the block edges included, out of place and in place (version counted up); a
    strided tensor of the same size takes the whole-tensor path, the same values."""
    monkeypatch.setattr(ghost, "_SCALAR_KERNELS", [True])
    block = ghost._SHRINK_BLOCK
    thr = ghost._FLUSH[dtype]
    g = torch.Generator().manual_seed(5)
    t = torch.randn(3 * block + 17, generator=g, dtype=dtype)
    mix = _tiny_mix(dtype).flatten()
    for edge in (0, block - 3, block, 2 * block + 1, t.numel() - mix.numel()):
        t[edge:edge + mix.numel()] = mix[: t.numel() - edge]
    t = t.view(-1, 1)
    want = torch.nn.functional.hardshrink(t, thr)
    got = ghost._shrink(t, thr)
    assert got.shape == t.shape and got.data_ptr() != t.data_ptr()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # the zeros' signs as the whole-tensor numpy pass gives them
    monkeypatch.setattr(ghost, "_SHRINK_BLOCK", 1 << 40)
    assert torch.equal(got.signbit(), ghost._shrink(t, thr).signbit())
    monkeypatch.setattr(ghost, "_SHRINK_BLOCK", block)
    u = t.clone()
    v0 = u._version
    assert ghost._shrink(u, thr, out=u) is u and u._version > v0
    torch.testing.assert_close(u, want, rtol=0, atol=0, equal_nan=True)
    wide = t.view(-1)[: 2 * block].view(2, block).t()  # not contiguous
    torch.testing.assert_close(ghost._shrink(wide, thr),
                               torch.nn.functional.hardshrink(wide, thr), rtol=0, atol=0,
                               equal_nan=True)
