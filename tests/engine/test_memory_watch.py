"""The memory watch of the proved-program match (dpclip.engine.memory_watch): byte copies of the
state a step reads from before the call. The attacks it closes are in test_hostile_review.py
(``numpy-shared-*``, ``numpy-view-from-construction``, ``numpy-write-after-last-use``,
``test_a_chain_weight_written_by_the_loss_never_exceeds_c``); these are its unit properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpclip.engine.memory_watch import MemoryWatch


def test_an_unseen_write_is_named_and_a_clean_watch_passes():
    a, b = np.zeros(4), np.zeros(3, dtype=np.float32)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    w = MemoryWatch()
    w.add([(ta, "parameter 'a'"), (tb, "buffer 'b'")])
    assert len(w) == 2
    w.check_args((ta, [tb]), {})
    assert w.changed is None
    b[1] = 1e-30  # one bit pattern differs: a value comparison of 0.0 and 1e-30 would also see it
    w.check_args((ta,), {})
    assert w.changed is None  # only the arguments of the call are compared before it
    w.check_args((), {"x": tb})
    assert w.changed == "buffer 'b'"


def test_views_share_their_storage_s_watch():
    """A view (another tensor object, a slice, a transpose) is checked against the storage it
    reads: the watch is by storage, not by tensor."""
    arr = np.ones((3, 4))
    t = torch.from_numpy(arr)
    w = MemoryWatch()
    w.add([(t, "the table")])
    w.add([(t[1:], "again")])  # the same storage: not copied twice, first name kept
    assert len(w) == 1
    arr[2, 3] = 5.0
    w.check_args((t.t()[0],), {})  # a view of a row that was not written: the storage was
    assert w.changed == "the table"


def test_a_write_restored_before_the_end_is_caught_at_its_use():
    arr = np.ones(5)
    t = torch.from_numpy(arr)
    w = MemoryWatch()
    w.add([(t, "k")])
    arr[0] = 2.0
    w.check_args((t,), {})  # the use between write and restore
    arr[0] = 1.0
    assert w.finish() == "k"


def test_a_write_after_the_last_use_is_caught_at_the_end():
    arr = np.ones(5)
    t = torch.from_numpy(arr)
    w = MemoryWatch()
    w.add([(t, "k")])
    w.check_args((t,), {})
    arr[:] = 3.0
    assert w.finish() == "k"


def test_refresh_accepts_a_write_the_match_saw():
    t = torch.ones(4, dtype=torch.float64)
    w = MemoryWatch()
    w.add([(t, "counter")])
    t.add_(1.0)  # an accepted operation wrote it
    w.refresh([t.untyped_storage().data_ptr()])
    w.check_args((t,), {})
    assert w.finish() is None


def test_tensors_without_memory_are_ignored():
    w = MemoryWatch()
    w.add([(torch.empty(3, device="meta"), "meta"), (torch.empty(0), "empty"),
           (torch.ones(2).to_sparse(), "sparse")])
    assert len(w) == 0
    assert w.finish() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_an_accelerator_the_checks_are_read_at_the_end():
    t = torch.ones(1000, device="cuda")
    w = MemoryWatch()
    w.add([(t, "gpu buffer")])
    w.check_args((t,), {})
    assert w.changed is None
    torch.cuda.synchronize()
    t[10] = 2.0  # (a write the match did not see, as through DLPack)
    w.check_args((t,), {})
    assert w.changed is None  # queued, not read yet
    assert w.finish() == "gpu buffer"


def test_a_tensor_moved_to_other_memory_is_caught():
    """``t.data = other`` swaps the memory without a version bump and without writing the watched
    bytes: the tensor no longer lives where it was copied from."""
    t = torch.ones(4, dtype=torch.float64)
    w = MemoryWatch()
    w.add([(t, "buffer 'k'")])
    with torch._C.DisableTorchFunction():
        t.data = torch.full((4,), 3.0, dtype=torch.float64)
    w.check_args((t,), {})
    assert w.changed == "buffer 'k'"
    w2 = MemoryWatch()
    u = torch.ones(2)
    w2.add([(u, "u")])
    u.data = torch.zeros(2)
    assert w2.finish() == "u"  # also when its only check is the last one


# ---------------------------------------------- view operations read no value (not compared)


def test_a_view_operation_is_not_compared_but_the_read_of_the_view_is():
    """A write before a view operation is seen when the view's values are read (the storage is
    the same); a write restored before any read changed no value the program used."""
    arr = np.ones(6)
    t = torch.from_numpy(arr)
    view, mm = torch.ops.aten.view.default, torch.ops.aten.mm.default
    w = MemoryWatch()
    w.add([(t, "k")])
    arr[0] = 2.0
    w.check_args((t, [2, 3]), {}, view)
    assert w.changed is None  # a view reads no value
    w.check_args((t.view(2, 3), t.view(3, 2)), {}, mm)
    assert w.changed == "k"  # the read of the view compares the storage
    w2 = MemoryWatch()
    w2.add([(t, "k")])
    arr[0] = 3.0
    w2.check_args((t, [2, 3]), {}, view)
    arr[0] = 2.0  # restored before any value was read
    assert w2.finish() is None


def test_a_view_of_a_tensor_moved_to_other_memory_is_caught():
    """The view operation does not compare bytes but its argument must still live where it was
    watched: a view of the new memory would be born watched with the new bytes."""
    t = torch.ones(4, dtype=torch.float64)
    w = MemoryWatch()
    w.add([(t, "buffer 'k'")])
    with torch._C.DisableTorchFunction():
        t.data = torch.full((4,), 3.0, dtype=torch.float64)
    w.check_args((t, [2, 2]), {}, torch.ops.aten.view.default)
    assert w.changed == "buffer 'k'"


def test_only_view_operations_skip_the_comparison():
    from dpclip.engine.memory_watch import reads_no_values

    aten = torch.ops.aten
    for f in (aten.view.default, aten.expand.default, aten.transpose.int, aten.permute.default,
              aten.unbind.int, aten.slice.Tensor, aten.as_strided.default, aten._unsafe_view.default,
              aten.t.default, aten.select.int):
        assert reads_no_values(f), f
    for f in (aten.clone.default, aten.mm.default, aten.add_.Tensor, aten.copy_.default,
              aten.transpose_.default, aten.index_select.default, aten.sum.default,
              aten.as_strided_.default, aten._to_copy.default, aten.contiguous.default,
              aten.reshape.default, aten.squeeze_.dim, aten.unsqueeze_.default):
        assert not reads_no_values(f), f


class _HiddenWriteAroundAView(torch.nn.Module):
    """Mixes the batch into ``h`` with no trace (version counter set back), then takes a view
    of it (no value read); ``restore``: the original bytes are put back before the view is read."""

    def __init__(self, restore: bool, move: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(5, 6), torch.nn.Linear(6, 3)
        self.restore, self.move = restore, move

    def forward(self, x):
        from tests.engine.test_hostile_review import _SW

        h = torch.tanh(self.fc1(x))
        if not _SW["on"]:
            return self.fc2(h.view(h.shape[0], 6))
        version = h._version
        with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            saved = h.clone()
            mixed = h + 5 * h.mean(0)
            if self.move:
                h.data = mixed
            else:
                h.copy_(mixed)
        torch._C._autograd._unsafe_set_version_counter((h,), (version,))
        v = h.view(h.shape[0], 6)
        if self.restore:
            with torch.no_grad(), torch._C.DisableTorchFunction(), \
                    torch._C._DisableTorchDispatch():
                h.copy_(saved)
            torch._C._autograd._unsafe_set_version_counter((h,), (version,))
        return self.fc2(v)


@pytest.mark.parametrize("engine", ["ghost", "auto"])
@pytest.mark.parametrize("case", ["kept", "restored", "moved"])
def test_a_hidden_write_around_a_view_never_exceeds_c(engine, case):
    """The view operation is not compared: the write kept until the view is read is refused
    there; restored before the read, the program ran on its own values (the step runs, within C);
    the tensor moved to other memory before the view is refused."""
    from dpclip.engine import AutoEngine, GhostEngine
    from tests.engine.test_hostile_review import ce, data, switched_loo

    eng = {"ghost": GhostEngine, "auto": AutoEngine}[engine]
    got = switched_loo(eng, lambda: _HiddenWriteAroundAView(case == "restored", case == "moved"),
                       data, ce, None)
    if case == "restored":
        assert got is not None and got <= 1 + 1e-9, got
    else:
        assert got is None or got <= 1 + 1e-9, got


class _AliasWriteAfterLayer(torch.nn.Module):
    """After ``fc2`` has read ``h``, ``h``'s memory is rewritten through a ``set_`` alias (its
    own version counter: ``h._version`` does not move) to mix the batch: the write is a traced
    operation the proof accepts (nothing mixed reaches the loss), but ghost reads ``fc2``'s
    per-example gradients from ``h`` after the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(5, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        out = self.fc2(h)
        z = torch.empty(0, dtype=h.dtype)
        z.set_(h)
        z.copy_(1000.0 * z.prod(0, keepdim=True).expand_as(z))
        return out


@pytest.mark.parametrize("engine", ["ghost", "auto"])
def test_a_layer_input_rewritten_through_an_alias_after_the_layer_is_refused(engine):
    """The fingerprint of ``fc2``'s input (its bytes when the layer returned) no longer matches
    when the engine reads it: refused (the version counter of ``h`` did not move)."""
    from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
    from tests.engine.helpers import clip_weights

    torch.manual_seed(0)
    model = _AliasWriteAfterLayer().double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    eng = {"ghost": GhostEngine, "auto": AutoEngine}[engine]()

    def ce(o, t):
        return torch.nn.functional.cross_entropy(o, t, reduction="none")

    try:
        res = eng.compute(model, ce, x, y, clip_weights(0.5), ParamGroups.flat(model))
    except UnsupportedModelError as exc:
        assert "rewritten" in str(exc) or "written" in str(exc), exc
        return
    assert res.engine_info.get("engine") == "vmap", res.engine_info
