import pytest

from dpclip.events import (
    ComposedEvent,
    GaussianEvent,
    NoOpEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
    event_from_dict,
)

EVENTS = [
    NoOpEvent(),
    GaussianEvent(1.5),
    ComposedEvent((GaussianEvent(1.0), GaussianEvent(10.0))),
    PoissonSampledEvent(0.01, ComposedEvent((GaussianEvent(1.0), GaussianEvent(2.0)))),
    SampledWithoutReplacementEvent(100, 10, GaussianEvent(1.0)),
    SelfComposedEvent(PoissonSampledEvent(0.5, GaussianEvent(0.7)), 12),
]


@pytest.mark.parametrize("ev", EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip(ev):
    assert event_from_dict(ev.to_dict()) == ev


def test_validation():
    with pytest.raises(ValueError, match="noise_multiplier"):
        GaussianEvent(-1.0)
    with pytest.raises(ValueError, match="sample_rate"):
        PoissonSampledEvent(1.5, GaussianEvent(1.0))
    with pytest.raises(ValueError, match="sample_size"):
        SampledWithoutReplacementEvent(10, 11, GaussianEvent(1.0))
    with pytest.raises(ValueError, match="unknown DP event type"):
        event_from_dict({"type": "laplace"})


def test_public_api_is_curated():
    import dpclip

    for name in dpclip.__all__:
        assert hasattr(dpclip, name), name
    assert "train" in dpclip.__all__ and "dp_step" in dpclip.__all__
