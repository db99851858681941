"""Ledger: run-length compression, step counting (anchors P10), JSON round trip, equality."""

import json

import pytest

from dpclip.accounting import Ledger, compute_epsilon, epsilon
from dpclip.events import (
    ComposedEvent,
    GaussianEvent,
    NoOpEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
)

A = PoissonSampledEvent(0.01, GaussianEvent(1.5))
B = PoissonSampledEvent(0.01, ComposedEvent((GaussianEvent(1.5), GaussianEvent(5.0))))


def test_run_length_compression_and_counts():
    led = Ledger()
    for _ in range(100_000):
        led.record(A)
    led.record(B, 3)
    led.record(B)
    led.record(A, 2)
    assert led.entries == ((A, 100_000), (B, 4), (A, 2))
    assert led.steps == 100_006
    assert len(led) == 100_006  # steps, not the 3 distinct groups (Opacus #834)
    assert bool(led) and not bool(Ledger())


def test_record_zero_and_bad_inputs():
    led = Ledger()
    led.record(A, 0)
    assert led.entries == () and len(led) == 0
    with pytest.raises(TypeError, match="event"):
        led.record((0.01, 1.0))  # a tuple is not an event
    with pytest.raises(ValueError, match="count"):
        led.record(A, -1)
    with pytest.raises(ValueError, match="count"):
        led.record(A, 1.5)
    with pytest.raises(ValueError, match="count"):
        led.record(A, True)


def test_equality_is_canonical():
    l1, l2 = Ledger(), Ledger()
    l1.record(A, 5)
    for _ in range(5):
        l2.record(A)
    assert l1 == l2
    l2.record(NoOpEvent())
    assert l1 != l2
    assert l1 != "not a ledger"
    l3 = l1.copy()
    l3.record(B)
    assert l1.steps == 5 and l3.steps == 6  # copy is independent


def test_json_round_trip():
    led = Ledger()
    led.record(A, 7)
    led.record(SampledWithoutReplacementEvent(1000, 10, GaussianEvent(2.0)), 2)  # serialisable
    led.record(SelfComposedEvent(GaussianEvent(3.0), 2))
    led.record(NoOpEvent(), 4)
    text = json.dumps(led.to_dict())
    back = Ledger.from_dict(json.loads(text))
    assert back == led
    assert back.entries == led.entries
    assert back.steps == 14


def test_from_dict_rejects_corruption():
    led = Ledger()
    led.record(A, 3)
    d = led.to_dict()
    d["steps"] = 4
    with pytest.raises(ValueError, match="corrupt"):
        Ledger.from_dict(d)
    with pytest.raises(ValueError, match="format"):
        Ledger.from_dict({**led.to_dict(), "format": 99})
    with pytest.raises(ValueError, match="entries"):
        Ledger.from_dict({"steps": 3})
    with pytest.raises(ValueError, match="malformed"):
        Ledger.from_dict({"entries": [{"count": 3}]})


def test_to_dp_event_structure_and_epsilon_agree():
    led = Ledger()
    led.record(A, 20)
    led.record(B, 10)
    ev = led.to_dp_event()
    assert ev == ComposedEvent((SelfComposedEvent(A, 20), SelfComposedEvent(B, 10)))
    for acc in ("pld", "rdp"):
        assert epsilon(led, 1e-5, acc) == pytest.approx(epsilon(ev, 1e-5, acc), abs=1e-12)


def test_empty_ledger_costs_nothing():
    rep = compute_epsilon(Ledger(), 1e-5, accountant="rdp")
    assert rep.epsilon == 0.0 and rep.steps == 0
    assert epsilon(Ledger(), 1e-5, "pld") == 0.0
    only_noops = Ledger()
    only_noops.record(NoOpEvent(), 50)
    assert epsilon(only_noops, 1e-5, "rdp-classic") == 0.0
    assert compute_epsilon(only_noops, 1e-5).steps == 50


def test_epsilon_grows_as_the_ledger_grows():
    led = Ledger()
    eps = []
    for _ in range(4):
        led.record(A, 100)
        eps.append(epsilon(led, 1e-5, "rdp"))
    assert all(b > a for a, b in zip(eps, eps[1:]))


def test_mixing_adjacencies_raises():
    led = Ledger()
    led.record(A, 3)
    led.record(SampledWithoutReplacementEvent(60000, 256, GaussianEvent(1.0)))
    for acc in ("pld", "rdp", "rdp-classic"):
        with pytest.raises(ValueError, match="add-remove-one.*replace-one|mixes"):
            epsilon(led, 1e-5, acc)
