"""The eighth to thirty-ninth hostile reviews' attacks, measured on whichever ``dpclip`` is
importable: for each attack and engine, the leave-one-out distance of the noise-free clipped sum
(``max_j ||S(X) - S(X without j)|| / C``; sound: <= 1) or, for state carried across calls, how far
the release of one batch moves when the PREVIOUS call saw another batch (sound: 0). "refused": the
engine raised (the first words of its error are kept).

Run ``PYTHONPATH=<src to measure>:. python benchmarks/review_attacks.py LABEL OUT.json [PREFIXES]``
(rows appended, replacing LABEL's for the attacks measured; PREFIXES such as ``15:,16:`` measure
only those attacks), then ``python benchmarks/review_attacks.py --table OUT.json`` for the
Markdown table beside it. The attacks are the tests' models (tests/engine/test_review8_*.py,
test_review9_*.py, tests/core/test_review10_mechanisms.py, tests/engine/test_review13_recompute.py,
test_review14_replay_shapes.py, test_review15_rows_coincide.py, test_review16_scale_alias.py,
test_review17_batch_in_data_dim.py, test_review19_layer_config.py,
test_review20_swaps_and_finalizers.py, test_review22_late_releases.py,
test_review23_held_until_read.py, test_review24_between_chunks.py, test_review26_joined_layouts.py,
test_review27_underflow.py, test_review28_caught_errors.py, test_known_trees.py,
test_review29_half_and_modes.py, test_review30_positions_and_generators.py,
test_review31_bits_and_draws.py).
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch


def _attacks():
    import dpclip
    from torch import nn

    from dpclip.clipping.adaclip import AdaClip
    from dpclip.clipping.fixed import FixedClip
    from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, ParamGroups, VmapEngine
    from dpclip.engine.summed import SummedEngine
    from dpclip.lipschitz.strategy import LipDpSgd
    from dpclip.training.sampling import PoissonSampler
    from dpclip.training.units import UnitConfig
    from tests.engine import test_review8_carry as r8
    from tests.engine import test_review8_rounding as r8r
    from tests.engine import test_review9_tables_and_geometry as r9
    from tests.engine.helpers import DT, outlier_batch
    from tests.engine.helpers import loo_distance as loo_of_fresh  # (fresh model per release)
    from tests.engine.test_separability_attacks import C, ce, clipped_sum, data, loo_distance

    engines = {"ghost": GhostEngine, "auto": AutoEngine, "vmap": VmapEngine, "naive": NaiveEngine,
               "summed": SummedEngine}

    def moved_r9(cls):
        def run(engine):
            x, y = data()
            model = r9._fresh(cls)
            got = []
            for first in (0, 1):
                model.buf.zero_()
                clipped_sum(engine(), model, ce, x[first:first + 2], y[first:first + 2])
                got.append(clipped_sum(engine(), model, ce, x[4:], y[4:]))
            r9._MODEL.clear()
            return float((got[0][0] - got[1][0]).norm()) / C, got[0][1]
        return run

    def moved_r8(cls, between=None):
        def run(engine):
            torch.manual_seed(0)
            model = cls().to(DT)
            x, y = data()
            got = []
            for first in (0, 1):
                r8._H.zero_()
                r8._PENDING.clear()
                clipped_sum(engine(), model, ce, x[first:first + 2], y[first:first + 2])
                if between is not None:
                    between()
                got.append(clipped_sum(engine(), model, ce, x[4:], y[4:]))
            r8._H.zero_()
            r8._PENDING.clear()
            return float((got[0][0] - got[1][0]).norm()) / C, got[0][1]
        return run

    def class_carry(engine):
        torch.manual_seed(0)
        model = r8._ClassCarry().to(DT)
        x, y = data()
        got = []
        try:
            for first in (0, 1):
                r8._ClassCarry.k = 0.0
                clipped_sum(engine(), model, ce, x[first:first + 2], y[first:first + 2])
                got.append(clipped_sum(engine(), model, ce, x[4:], y[4:]))
        finally:
            r8._ClassCarry.k = 0.0
        return float((got[0][0] - got[1][0]).norm()) / C, got[0][1]

    def loo(build, b=8):
        def run(engine):
            torch.manual_seed(0)
            model = build().to(DT)
            x, y = data(b=b)
            eng = engine()
            return loo_distance(eng, model, ce, x, y), clipped_sum(eng, model, ce, x, y)[1]
        return run

    from tests.core import test_review10_mechanisms as r10

    def flat_groups(engine):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
        names = [n for n, _ in model.named_parameters()]
        groups = ParamGroups(tuple(names), tuple((n,) for n in names))
        x, y = data()
        full, out = r10._step(engine(), model, x, y, FixedClip(C), groups)
        worst = max(float((full - r10._step(engine(), model, x[keep], y[keep], FixedClip(C),
                                             groups)[0]).norm())
                    for keep in ([i for i in range(8) if i != j] for j in range(8)))
        return worst / out.sensitivity, out.engine_info

    def bc_carry(engine):
        g = torch.Generator().manual_seed(0)
        xb = torch.randn(1, 4, 5, generator=g, dtype=DT)
        xb[..., 0] = 1.0
        xn = xb.clone()
        xn[0, 0, 0] = -10.0  # the first call's neighbour
        yb = torch.zeros(1, 4, dtype=torch.long)
        rel = []
        for first in (xb, xn):
            torch.manual_seed(0)
            m = r10._Carry().to(DT)
            kw = dict(loss=r10._linear_loss, unit=UnitConfig(unit="bc"),
                      sampler=PoissonSampler(1000, 4))
            r10._step(engine(), m, first, yb, FixedClip(C), ParamGroups.flat(m), ebs=1.0, **kw)
            r, out = r10._step(engine(), m, xb, yb, FixedClip(C), ParamGroups.flat(m), ebs=1.0,
                               **kw)
            rel.append(r)
        return float((rel[0] - rel[1]).norm()) / C, out.engine_info

    def adaclip_carry(engine):
        x, y = data()
        x[0] = x[0].abs() + 4.0  # example 0's feature sum > 10 flips the next call
        xn = x.clone()
        xn[0] = 0.0
        rel = []
        for first in (x, xn):
            torch.manual_seed(0)
            m = r10._KeepsAttr().to(DT)
            r10._step(engine(), m, first, y, AdaClip(C), ParamGroups.flat(m))
            r, out = r10._step(engine(), m, x, y, AdaClip(C), ParamGroups.flat(m))
            rel.append(r)
        return float((rel[0] - rel[1]).norm()) / out.sensitivity, out.engine_info

    def lip_prehook(engine):
        m = r10._lip_model("pre-hook")
        strat = LipDpSgd(input_norm=1.0).bind(m, (5,))
        x, y = data()
        step = r10._lip_step
        full, out = step(m, strat, x, y, engine())
        worst = max(float((full - step(m, strat, x[keep], y[keep], engine())[0]).norm())
                    for keep in ([i for i in range(8) if i != j] for j in range(8)))
        return worst / out.sensitivity, out.engine_info

    def resume_neighbour(engine_cls):
        g = torch.Generator().manual_seed(0)
        xs = torch.randn(16, 5, generator=g, dtype=DT)
        ys = torch.randint(0, 3, (16,), generator=g)
        other = xs.clone()
        other[0] = 5 * other[0]

        def build():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)

        def run(d):
            return dpclip.make_private(build(), None, (d, ys), noise_multiplier=1.0, steps=50,
                                       batch_size=15, engine=engine_cls.name, verbose=False)

        dp = run(xs)
        bx, by = dp.sample()
        dp.backward(bx, by)
        ck = dp.state_dict()
        outs = []
        for d in (xs, other):
            dp2 = run(d)
            dp2.load_state_dict(ck)
            bx, by = dp2.sample()
            dp2.backward(bx, by)
            outs.append(torch.cat([p.grad.reshape(-1) for p in dp2.model.parameters()]) * 15)
        return float((outs[0] - outs[1]).norm()) / dp.strategy.clip_norm, {"engine": engine_cls.name}

    from tests.engine import test_review13_recompute as r13

    def global_carry(engine):
        torch.manual_seed(0)
        model = r13._model(r13._GlobalB(3))
        x, y = data()
        try:
            clipped_sum(engine(), model, ce, x, y)  # leaves the batch size 8 in the global
            after, info = clipped_sum(engine(), model, ce, x[1:], y[1:])
            r13._G.clear()
            clean, _ = clipped_sum(engine(), model, ce, x[1:], y[1:])
        finally:
            r13._G.clear()
        return float((after - clean).norm()) / C, info

    def loo13(build):
        def run(engine):
            torch.manual_seed(0)
            model = r13._model(build(3))
            x, y = data()
            try:
                return loo_distance(engine(), model, ce, x, y), \
                    clipped_sum(engine(), model, ce, x, y)[1]
            finally:
                r13._G.clear()
        return run

    from tests.engine import test_review14_replay_shapes as r14

    def loo14(name):
        def run(engine):
            torch.manual_seed(0)
            model = r14.CASES[name]().to(DT)
            x, y = data()
            try:
                return loo_distance(engine(), model, ce, x, y), \
                    clipped_sum(engine(), model, ce, x, y)[1]
            finally:
                r14._G.clear()
        return run

    from tests.engine import test_review15_rows_coincide as r15
    from tests.engine import test_review16_scale_alias as r16

    def loo15(how):
        def run(engine):
            torch.manual_seed(0)
            model = r15._Net(how).to(DT)
            x, y = r15._data(6, 4 if how == "sum" else r15.T)
            full, res = r15._sum(engine(), model, x, y)
            worst = max(float((full - r15._sum(engine(), model, x[keep], y[keep])[0]).norm())
                        for keep in ([i for i in range(6) if i != j] for j in range(6)))
            return worst / r15.C, res.engine_info
        return run

    def loo16(engine):
        torch.manual_seed(0)
        x = torch.randn(6, 5, 4, dtype=DT)
        y = torch.randint(0, 3, (6,))
        model = r16._Model(1000.0)
        full = r16._release(engine(), model, x, y)
        worst = max(float((full - r16._release(engine(), model, x[keep], y[keep])).norm())
                    for keep in ([i for i in range(6) if i != j] for j in range(6)))
        return worst / r16.C, {"engine": getattr(engine, "name", None)}

    from tests.engine import test_review17_batch_in_data_dim as r17

    def loo17(engine):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 3, generator=g, dtype=DT) * 2
        y = torch.zeros(8, dtype=torch.long)
        model = r17._Net("expand_prod")
        full, res = r17._release(engine(), model, x, y)
        worst = max(float((full - r17._release(engine(), model, x[keep], y[keep])[0]).norm())
                    for keep in ([i for i in range(8) if i != j] for j in range(8)))
        return worst / r17.C, res.engine_info

    from tests.engine import test_review19_layer_config as r19

    def loo19(make):
        def run(engine):
            g = torch.Generator().manual_seed(4)
            x = 3 * torch.randn(4, 2, 4, generator=g, dtype=DT)
            y = torch.randint(0, 3, (4,), generator=g)
            return loo_of_fresh(engine, make, x, y, r19.C), \
                {"engine": getattr(engine, "name", None)}
        return run

    from tests.engine import test_review20_swaps_and_finalizers as r20

    def loo20(make, shape, b=8, outlier=False):
        def run(engine):
            g = torch.Generator().manual_seed(0 if outlier else 4)
            x = (1 if outlier else 3) * torch.randn(b, *shape, generator=g, dtype=DT)
            if outlier:
                x[0] *= 50
            y = torch.randint(0, 3, (b,), generator=g)
            return loo_of_fresh(engine, make, x, y, r20.C), \
                {"engine": getattr(engine, "name", None)}
        return run

    from tests.engine import test_review22_late_releases as r22

    def loo22(engine):
        g = torch.Generator().manual_seed(3)
        x = 3 * torch.randn(4, 2, 6, generator=g, dtype=DT)
        y = torch.randint(0, 3, (4,), generator=g)
        return loo_of_fresh(engine, r22._FinalizerOnConvInput, x, y, r22.C), \
            {"engine": getattr(engine, "name", None)}

    from tests.engine import test_review23_held_until_read as r23

    def loo23(engine):
        x, y = outlier_batch()

        def release(xs, ys):
            model = r23._make()
            res = engine().compute(model, r23._restoring_loss, xs, ys, r23.clip_weights(0.5),
                                   ParamGroups.flat(model))
            return torch.cat([g.reshape(-1) for g in res.grads.values()])

        full = release(x, y)
        worst = max(float((full - release(x[keep], y[keep])).norm()) / 0.5
                    for keep in ([i for i in range(8) if i != j] for j in range(8)))
        return worst, {"engine": getattr(engine, "name", None)}

    from tests.engine import test_review24_between_chunks as r24

    def loo24(engine):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(8, 5, generator=g, dtype=DT), torch.randint(0, 3, (8,), generator=g)
        x[0] *= 50
        chunked = lambda: engine(max_physical_batch=1)  # noqa: E731
        chunked.name = getattr(engine, "name", None)
        return loo_of_fresh(chunked, r24._CarriesBetweenChunks, x, y, r24.C), \
            {"engine": getattr(engine, "name", None)}

    four = ("ghost", "auto", "vmap", "naive")
    from tests.engine import test_review26_joined_layouts as r26
    from tests.engine import test_review27_underflow as r27
    from tests.engine import test_review28_caught_errors as r28

    def loo26(engine):
        x, y = r26._data()
        return r26._loo(engine, "mean", x, y), {"engine": getattr(engine, "name", None)}

    def loo27(kind):
        def run(engine):
            x, y = r27._data(kind)
            return r27._loo(engine, lambda: r27._Scaled(kind, 1e-24, 1e19), x, y, 1e-7), \
                {"engine": getattr(engine, "name", None)}
        return run

    def loo28(engine):
        x, y = r28._data()
        return loo_of_fresh(engine, lambda: r28._Flips("index", mixing=True), x, y, r28.C), \
            {"engine": getattr(engine, "name", None)}

    from dpclip.engine.known_losses import cross_entropy_per_example as known_ce
    from tests.engine import test_known_trees as kt
    from tests.engine import test_review29_half_and_modes as r29
    from tests.engine import test_review30_positions_and_generators as r30
    from tests.engine import test_review31_bits_and_draws as r31

    def _named(engine):
        return {"engine": getattr(engine, "name", None)}

    def loo38(kind):  # test_review38_reduction: what runs inside or around the reductions
        from tests.engine import test_review38_reduction as r38
        from tests.engine.helpers import loo_distance

        def run(engine):
            if kind == "profile":
                x, y = r38._heads_batch()
                try:
                    return loo_distance(engine, r38.LeavesAProfiler, x, y, 0.1), {}
                finally:
                    sys.setprofile(None)
            if kind == "self-removing":
                x, y = r38._heads_batch()
                try:
                    return loo_distance(engine, r38.SelfRemovingProfiler, x, y, 0.1), {}
                finally:
                    sys.setprofile(None)
            if kind == "autocast":
                x, y = r38._aligned()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return loo_distance(engine, r38.OutsideThenLayer, x, y, 1e-3, exact=True), {}
            x, y = r38.r37._sequences()  # flush-to-zero, C = 1.5e-38
            try:
                torch.set_flush_denormal(True)
                full = r38._release(engine, x, y, 1.5e-38)
                left = [r38._release(engine, x[[i for i in range(8) if i != j]],
                                     y[[i for i in range(8) if i != j]], 1.5e-38)
                        for j in range(8)]
            finally:
                torch.set_flush_denormal(False)
            return max(float((full.double() - v.double()).norm()) / 1.5e-38 for v in left), {}
        return run

    def loo37(kind):  # test_exact_float32: autocast inside the ghost reduction
        from tests.engine import test_exact_float32 as r37
        from tests.engine.helpers import loo_distance

        def run(engine):
            import gc

            x, y = r37._sequences()
            if kind == "autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return loo_distance(engine, r37.Alternating, x, y, 1e-3, exact=True), {}
            old = gc.get_threshold()
            r37._Bomb.armed = True
            try:
                return loo_distance(engine, r37.GarbageSwitch, x, y, 1e-3, exact=True), {}
            finally:
                r37._Bomb.armed = False
                gc.set_threshold(*old)
                torch.set_autocast_enabled("cpu", False)
                gc.collect()
        return run

    def loo_spoofed_file(engine):  # test_known_trees: a user class given dpclip's file name
        import dpclip.models.architectures as arch

        class Evil(nn.Module):
            KNOWN_PROGRAM = {"children": {"fc": nn.Linear}}

            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.fc = nn.Linear(4, 3).to(DT)

            def forward(self, x):
                return self.fc(x + 20 * x.sum(0))

        Evil.forward.__code__ = Evil.forward.__code__.replace(co_filename=arch.__file__)
        x, y = r30._data()
        return loo_of_fresh(engine, Evil, x, y, 0.5, loss=known_ce), _named(engine)

    def loo_known_tree_patched(owner, attr, make_patch, b=6):
        def run(engine):
            original = getattr(owner, attr)
            setattr(owner, attr, make_patch(original))
            try:
                x, y = kt._data(b)
                return loo_of_fresh(engine, kt._model, x, y, kt.C, loss=known_ce), _named(engine)
            finally:
                setattr(owner, attr, original)
        return run

    def mixing_iter(original):  # test_known_trees: q, k, v = t mixes the batch
        return lambda self: original(self + 20 * self.sum(1, keepdim=True)) \
            if self.ndim == 5 else original(self)

    def extra_module_iter(original):  # test_known_trees: for layer in self.layers yields a mixer
        class _Mix(nn.Module):
            def forward(self, x):
                return x + x.flip(0)

        extra = _Mix()
        return lambda self: iter(list(original(self)) + [extra])

    def mixing_unbind(original):  # test_review31: Tensor.__iter__ calls self.unbind(0)
        return lambda self, dim=0: original(self + 20 * self.sum(1, keepdim=True), dim) \
            if self.ndim == 5 else original(self, dim)

    def loo29_half(c, scales):
        def run(engine):
            x, y = r29._half_data()
            return max(loo_of_fresh(engine, r29._half, x, y, c, loss=r29._scaled(s))
                       for s in scales), _named(engine)
        return run

    def loo29_caught(engine):
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(8, 5, generator=g, dtype=DT).abs(), torch.randint(0, 3, (8,),
                                                                               generator=g)
        x[3, 0] = -1.0
        return loo_of_fresh(engine, r29._Flips, x, y, 0.5), _named(engine)

    def loo30(how):
        def run(engine):
            x, y = r30._data()
            return loo_of_fresh(engine, lambda: r30._Positions(how), x, y, 0.1), _named(engine)
        return run

    def loo30_held(engine):
        x, y = r30._data(16)
        return loo_of_fresh(engine, lambda: r30._HeldGenerator(False), x, y, 0.1), _named(engine)

    def replaced30_draws(engine):  # ||S(X) - S(X')|| / C, example 0 replaced (sound: <= 2)
        x, y = r30._data()
        x *= 3
        big = x.clone()
        big[0] *= 100
        rel = []
        for xs in (x, big):
            model = r30._DrawsMore()
            torch.manual_seed(7)  # (the same seeds for both releases)
            res = engine().compute(model, ce, xs, y, r30.clip_weights(0.1),
                                   ParamGroups.flat(model))
            rel.append(torch.cat([g.reshape(-1) for g in res.grads.values()]))
        return float((rel[0] - rel[1]).norm()) / 0.1, _named(engine)

    def loo31_negzero(engine):
        x, y = r31._data()
        return loo_of_fresh(engine, r31._NegZero, x, y, 0.5), _named(engine)

    def loo31_positional(how):
        def run(engine):
            x, y = r31._data()
            return loo_of_fresh(engine, lambda: r31._Positional(how), x, y, 0.1), _named(engine)
        return run

    def loo31_reseeds(engine):
        x, y = r31._data(16)
        return loo_of_fresh(engine, r31._Reseeds, x, y, 0.1), _named(engine)

    def loo31_counter(engine):
        x, y = r31._data(16)

        def make():
            r31._COUNT[0] = 0
            return r31._Counts()

        try:
            return loo_of_fresh(engine, make, x, y, 0.1), _named(engine)
        finally:
            r31._COUNT[0] = 0

    def loo40(kind):  # test_review40_signals: a signal handler inside the reduction
        import signal

        from tests.engine import test_review40_signals as r40
        from tests.engine.helpers import loo_distance

        def run(engine):
            old = signal.getsignal(signal.SIGALRM)
            try:
                if kind == "constructor":
                    signal.signal(signal.SIGALRM, r40._Switch())
                    signal.setitimer(signal.ITIMER_REAL, 5e-5, 5e-5)
                    x, y = r40._sequences()
                    return loo_distance(engine, r40.Alternating, x, y, 1e-3, exact=True), {}
                signal.signal(signal.SIGALRM, lambda s, f: None)
                g = torch.Generator().manual_seed(0)
                x = torch.randn(8, 4, generator=g, dtype=torch.float64)
                y = torch.randint(0, 3, (8,), generator=g)
                return loo_distance(engine, r40._Installs, x, y, 0.1), {}
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
                torch.set_autocast_enabled("cpu", False)
        return run

    def loo41(model):  # test_review41_dispatcher: Python kernels through the Python dispatcher
        from tests.engine import test_review41_dispatcher as r41
        from tests.engine.helpers import loo_distance

        def run(engine):
            fixture = r41.kernels.__wrapped__()
            next(fixture)
            try:
                x, y = r41._batch()
                return loo_distance(engine, getattr(r41, model), x, y, 0.1), {}
            finally:
                next(fixture, None)
        return run

    def loo42(model, c=0.01):  # test_review42_kernels_and_gc: torch.library kernels over ATen
        from tests.engine import test_review42_kernels_and_gc as r42
        from tests.engine.helpers import loo_distance

        def run(engine):
            try:
                x, y = r42._batch()
                return loo_distance(engine, getattr(r42, model), x, y, c), {}
            finally:
                while r42._LIBS:
                    r42._LIBS.pop()._destroy()
        return run

    def loo43(engine):  # test_review43_around_the_engines: a mode the constructor left on
        from tests.engine import test_review43_around_the_engines as r43
        from tests.engine.helpers import loo_distance

        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(8, 4, generator=g, dtype=DT), torch.randint(0, 3, (8,), generator=g)
        made = []

        def make():
            made.append(r43._EntersAMode())
            return made[-1]
        try:
            return loo_distance(engine, make, x, y, 0.01), {}
        finally:
            for m in reversed(made):
                m.mode.__exit__(None, None, None)

    def loo45(engine):  # test_review45_finalizers: a finalizer the engine released
        from tests.engine import test_review45_finalizers as r45
        from tests.engine.helpers import loo_distance

        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 4, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        try:
            return loo_distance(engine, r45._PlantsInTheEngine, x, y, 0.1), {}
        finally:
            sys.setprofile(None)

    def loo46(name):  # test_review46_frames: finalizers that walk the frames
        def run(engine):
            from tests.engine import test_review46_frames as r46
            from tests.engine.helpers import loo_distance

            x, y = r46._data()
            return loo_distance(engine, getattr(r46, name), x, y, 0.1), {}
        return run

    def loo47(name, how=None):  # test_review46_frames: the forty-seventh review's frame sources
        def run(engine):
            from tests.engine import test_review46_frames as r46
            from tests.engine.helpers import loo_distance

            cls = getattr(r46, name)
            if how is not None:
                cls = type("M", (cls,), {"how": how})
            x, y = r46._data()
            return loo_distance(engine, cls, x, y, 0.1), {}
        return run

    def loo49(dtype):  # test_review49_mixed_dtypes: a narrow parameter in a float64 model
        def run(engine):
            from tests.engine import test_review49_mixed_dtypes as r49
            from tests.engine.helpers import loo_distance

            g = torch.Generator().manual_seed(1)
            x = torch.randn(6, 4, generator=g, dtype=torch.float64)
            y = torch.randint(0, 3, (6,), generator=g)
            return loo_distance(engine, r49._model(dtype), x, y, 1e-30, exact=True), {}
        return run

    return engines, [
        ("49: a float32 parameter on the per-layer path of a float64 model, gradients ~1e-24 "
         "(LOO, C 1e-30)", loo49(torch.float32), ("ghost", "auto")),
        ("47: a generator's frame read at import, resumed by a finalizer inside the step, walks "
         "f_back to ghost's sum x50 (LOO; open)", loo47("_ResumesAGenerator"), ("ghost", "auto")),
        ("47: a frame asked by a code object with a forged torch file name (LOO)",
         loo47("_Sources", "forged"), ("ghost", "auto")),
        ("47: traceback.extract_stack with traceback.walk_stack rebound (LOO)",
         loo47("_Sources", "extract_patched"), ("ghost", "auto")),
        ("46: a finalizer on a layer's input walks the frames to ghost's sum after the reduction, "
         "x50 (LOO)", loo46("_FinalizerScales"), ("ghost", "auto")),
        ("46: a finalizer plants an object in ghost's list of chunks; its __del__ scales the sums "
         "x50 outside every isolation (LOO)", loo46("_Plants"), ("ghost", "auto")),
        ("45: a finalizer planted in ghost's list of chunks sets a profile function scaling the "
         "result x50 (LOO)", loo45, ("ghost", "auto")),
        ("44: a torch.library kernel over tanh on vmap's batching key mixes the batch (LOO, C 0.1)",
         loo42("_BatchedKernel", 0.1), ("vmap", "auto")),
        ("43: a torch function mode the constructor left on divides the norms by 1000 (LOO, "
         "C 0.01)", loo43, ("vmap", "naive", "ghost")),
        ("42: a torch.library kernel over aten::nextafter, registered in the constructor (LOO, "
         "C 0.01)", loo42("_RegistersInInit"), ("ghost", "auto")),
        ("42: the same kernel registered by the forward (LOO, C 0.01)",
         loo42("_RegistersInForward"), ("ghost", "auto")),
        ("40: a SIGALRM handler installed before the step switches autocast inside the reduction "
         "(LOO, C 1e-3)", loo40("constructor"), ("ghost", "auto")),
        ("40: a SIGALRM handler installed by the forward scales the captured activations x50 "
         "(LOO)", loo40("forward"), ("ghost", "auto")),
        ("41: the Python dispatcher switched on in the constructor, kernels scale the captured "
         "activations x50 (LOO)", loo41("_InInit"), ("ghost", "auto")),
        ("41: the Python dispatcher left on by the forward (LOO)", loo41("_LeavesOn"),
         ("ghost", "auto")),
        ("29: a user class's forward given dpclip's file name (co_filename), declared program "
         "(LOO)", loo_spoofed_file, ("ghost", "auto")),
        ("29: Tensor.__iter__ replaced, mixing the batch, in a known tree (LOO, B 6)",
         loo_known_tree_patched(torch.Tensor, "__iter__", mixing_iter), ("ghost", "auto")),
        ("29: ModuleList.__iter__ replaced, yielding a mixing module, in a known tree (LOO, B 6)",
         loo_known_tree_patched(nn.ModuleList, "__iter__", extra_module_iter), ("ghost", "auto")),
        ("29: float16 weights below the normal range (LOO, C 2e-6, float16)",
         loo29_half(2e-6, (10.0, 70.0)), ("ghost", "auto", "vmap")),
        ("29: float16 weights below the normal range (LOO, C 5e-7, float16)",
         loo29_half(5e-7, (0.5, 1.0, 2.0, 3.0, 10.0, 70.0)), ("ghost", "auto", "vmap")),
        ("29: float16 sum rounded before the noise, C in the subnormal range "
         "(LOO, C 1.26e-7; closed in 9bb26d5)",
         loo29_half(1.26e-7, (0.5, 20.0)), ("ghost", "auto", "vmap")),
        ("29: an error caught with torch functions off (LOO, open under vmap)", loo29_caught,
         ("vmap", "ghost")),
        ("30: per-layer c * s on a position constant, rows differing (LOO, B 8)",
         loo30("per-layer"), ("ghost", "auto")),
        ("30: ruled Embedding on arange(B) % 2 (LOO, B 8)", loo30("embedding"), ("ghost", "auto")),
        ("30: frac of a ruled Embedding on arange(B) % 2 (LOO, B 8)", loo30("embedding-frac"),
         ("ghost", "auto")),
        ("30: a draw from a generator the model holds (LOO, B 16)", loo30_held,
         ("vmap", "auto", "naive")),
        ("30: one example's extra default-generator draw under naive (example 0 replaced, "
         "||S(X) - S(X')|| / C, sound <= 2)", replaced30_draws, ("naive",)),
        ("31: Tensor.unbind replaced (through Tensor.__iter__), mixing the batch, in a known tree "
         "(LOO, B 6)", loo_known_tree_patched(torch.Tensor, "unbind", mixing_unbind),
         ("ghost", "auto")),
        ("31: constant rows differing in the sign of zero, atan2 (LOO, B 8)", loo31_negzero,
         ("ghost", "auto")),
        ("31: a held generator passed positionally, poisson (LOO, B 8)",
         loo31_positional("poisson"), ("vmap", "auto", "naive")),
        ("31: a held generator passed positionally, binomial (LOO, B 8)",
         loo31_positional("binomial"), ("vmap", "auto", "naive")),
        ("31: the default generator re-seeded in the forward (LOO, B 16, open under vmap)",
         loo31_reseeds, ("vmap",)),
        ("31: a module-global counter (LOO, B 16, open under naive)", loo31_counter, ("naive",)),
        ("39: a profile function that removes itself scales the weights x50 (LOO)",
         loo38("self-removing"), ("ghost", "auto", "vmap", "naive")),
        ("38: a profile function left set by the forward scales the weights x50 (LOO)",
         loo38("profile"), ("ghost", "auto", "vmap", "naive")),
        ("38: the vmap / naive reduction under CPU autocast (LOO, B 64, C 1e-3, float32)",
         loo38("autocast"), ("auto", "vmap", "naive")),
        ("38: flush-to-zero set by the user (LOO, C 1.5e-38, float32, measured without it)",
         loo38("ftz"), ("ghost", "vmap")),
        ("37: the step run under CPU autocast, bfloat16 Gram matrices (LOO, C 1e-3, float32)",
         loo37("autocast"), ("ghost", "auto")),
        ("37: a cyclic-garbage finalizer switches autocast on inside the reduction (LOO, C 1e-3)",
         loo37("garbage"), ("ghost", "auto")),
        ("26: per-layer output mixing beside a (0, 2) output (LOO, B 8, one large example)",
         loo26, ("ghost", "auto", "vmap")),
        ("27: underflowed ||a||^2 in a 2-D Linear (LOO, C 1e-7, float32)", loo27("linear"),
         ("ghost", "auto", "vmap")),
        ("27: underflowed Gram matrices, Linear on a sequence (LOO, C 1e-7, float32)",
         loo27("seq"), ("ghost", "auto", "vmap")),
        ("27: underflow in Conv2d (LOO, C 1e-7, float32)", loo27("conv"), ("ghost", "auto")),
        ("27: underflow in a tied weight's cross terms (LOO, C 1e-7, float32)", loo27("tied"),
         ("ghost", "auto")),
        ("28: caught index_select error flips every example under vmap (LOO)", loo28,
         ("vmap", "auto")),
        ("24: finalizer between chunks writes a buffer (LOO, chunks of 1)", loo24,
         ("ghost", "auto")),
        ("23: finalizer rewrites BatchNorm statistics before the rules read (LOO)", loo23,
         ("ghost", "auto")),
        ("22: finalizer fired by the Conv rule's own release (LOO)", loo22, ("ghost", "auto")),
        ("20: eval BatchNorm fed the batch's statistics for its call (LOO)",
         loo20(lambda: r20._BatchStats("batch"), (5,), outlier=True), ("ghost", "auto")),
        ("20: Conv padding list held by the class, set for the call (LOO)",
         loo20(r20._ClassPadding, (2, 4)), ("ghost", "auto")),
        ("20: __del__ rewrites a layer input after the backward (LOO)",
         loo20(lambda: r20._DropsATrigger(False), (5,), b=4), ("ghost", "auto")),
        ("19: Conv padding list that shifts the batch (LOO)", loo19(r19._chain), ("ghost", "auto")),
        ("19: the same padding set for the conv's call only (LOO)", loo19(r19._SwitchesPadding),
         ("ghost", "auto")),
        ("17: example data copied along a B-sized dimension, prod (LOO)", loo17,
         ("ghost", "auto")),
        ("15: a (6, d) buffer argument sliced at B = 6 (LOO)", loo15("sum"), ("ghost", "auto")),
        ("15: a (T, d) table argument sliced at B = T (LOO)", loo15("table"), ("ghost", "auto")),
        ("16: scale operand rewritten through a set_ alias (LOO)", loo16, ("ghost", "auto")),
        ("14: replay reads zeros(1, B, d) whole, prod (LOO)", loo14("argument-prod"),
         ("ghost", "auto")),
        ("14: replay reads zeros(1, B, d) from a global, prod (LOO)", loo14("global-prod"),
         ("ghost", "auto")),
        ("14: as_strided of a (1, 1) slice of zeros(8, B) (LOO)", loo14("as_strided-of-a-slice"),
         ("ghost", "auto")),
        ("13: per-layer re-run reads the batch size from an attribute (LOO)", loo13(r13._KeepsB),
         ("ghost", "auto")),
        ("13: per-layer re-run reads the batch size from a global (LOO)", loo13(r13._GlobalB),
         ("ghost", "auto")),
        ("13: a global from the previous call (moved)", global_carry, ("ghost", "auto")),
        ("10: flat strategy, 4 parameter groups (LOO / S)", flat_groups, four),
        ("10: batch clipping unit carry, next call (moved / C)", bc_carry, ("vmap",)),
        ("10: AdaClip chunk carry, next call (moved / sensitivity)", adaclip_carry,
         ("auto", "vmap")),
        ("10: Lip-DP-SGD forward pre-hook x50 (LOO / certified sensitivity)", lip_prehook,
         ("summed",)),
        ("10: make_private resume on a neighbouring dataset (noise-free difference / C)",
         resume_neighbour, ("ghost", "vmap")),
        ("8: structure-method override carries (moved)", moved_r8(r8._Override), four),
        ("8: loop writes a global between steps (moved)", moved_r8(r8._Carries, r8._release),
         ("ghost", "auto")),
        ("8: class named torch's, class attribute carry (moved)", class_carry, ("vmap",)),
        ("8: batch-dependent rounding (LOO, open)", loo(r8r._Amplifies, 16), four),
        ("9: dict-subclass _modules carries (moved)", moved_r9(r9._TableCarry), four),
        ("9: Parameter subclass property carries (moved)", moved_r9(r9._ParamCarry), four),
        ("9: as_strided_ unseen (LOO)", loo(lambda: r9._Restrides(False)), ("ghost", "auto")),
        ("9: swap_tensor_impl unseen (LOO)", loo(lambda: r9._Restrides(True)), ("ghost", "auto")),
    ]


def measure(label: str, only: str | None = None) -> list[dict]:
    engines, attacks = _attacks()
    rows = []
    for name, run, which in attacks:
        if only is not None and not name.startswith(tuple(only.split(","))):
            continue
        for e in which:
            row = {"attack": name, "code": label, "engine": e, "device": "cpu",
                   "cpu": platform.machine(), "torch": torch.__version__,
                   "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            try:
                value, info = run(engines[e])
                row["value_over_C"] = round(value, 4)
                row["ran_on"] = (info or {}).get("engine") or e
            except Exception as exc:  # noqa: BLE001 - a refusal is the measurement
                row["refused"] = f"{type(exc).__name__}: {str(exc)[:90]}"
            rows.append(row)
            print(name, e, row.get("value_over_C", row.get("refused")), flush=True)
    return rows


def table(path: str) -> str:
    rows = json.load(open(path))
    codes = list(dict.fromkeys(r["code"] for r in rows))
    cols = [(c, e) for c in codes for e in ("ghost", "auto", "vmap", "naive", "summed")
            if any(r["code"] == c and r["engine"] == e for r in rows)]
    out = ["# The eighth to forty-ninth hostile reviews' attacks (benchmarks/review_attacks.py)",
           "",
           "Per attack and engine: LOO = `max_j ||S(X) - S(X \\ j)|| / C` (sound: <= 1) or, for a "
           "carry, how far one batch's release moves when the previous call saw another batch "
           "(sound: 0); float64, C 0.5, CPU, torch " + rows[0]["torch"] + ". `refused`: the "
           "engine raised; the engine that ran in brackets.", "",
           "| attack | " + " | ".join(f"{c} {e}" for c, e in cols) + " |",
           "|---|" + "---|" * len(cols)]
    for a in dict.fromkeys(r["attack"] for r in rows):
        cells = []
        for c, e in cols:
            r = next((r for r in rows if r["attack"] == a and r["code"] == c and r["engine"] == e),
                     None)
            cells.append("" if r is None else "refused" if "refused" in r else
                         f"{r['value_over_C']:.3f} ({r['ran_on']})")
        out.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        md = table(sys.argv[2])
        open(sys.argv[2].rsplit(".", 1)[0] + ".md", "w").write(md)
        print(md)
    else:
        label, path = sys.argv[1], sys.argv[2]
        only = sys.argv[3] if len(sys.argv) > 3 else None  # attack prefixes, e.g. "15:,16:"
        try:
            old = json.load(open(path))
        except FileNotFoundError:
            old = []
        new = measure(label, only)
        done = {(r["code"], r["attack"], r["engine"]) for r in new}
        old = [r for r in old if (r["code"], r["attack"], r["engine"]) not in done] + new
        json.dump(old, open(path, "w"), indent=1)
