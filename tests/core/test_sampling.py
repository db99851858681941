import math

import pytest
import torch
from scipy import stats

from dpclip.events import (
    ADD_REMOVE,
    REPLACE_ONE,
    GaussianEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
)
from dpclip.training.sampling import FixedSizeSampler, PoissonSampler, make_sampler


def test_poisson_batch_size_is_binomial_and_inclusion_uniform():
    n, b, reps = 200, 20.0, 3000
    s = PoissonSampler(n, b)
    g = torch.Generator().manual_seed(1)
    sizes, counts = [], torch.zeros(n)
    for _ in range(reps):
        idx = s.sample(g)
        sizes.append(len(idx))
        counts[idx] += 1
        assert len(torch.unique(idx)) == len(idx)
    q = b / n
    mean, var = sum(sizes) / reps, torch.tensor(sizes, dtype=torch.float64).var().item()
    assert abs(mean - n * q) < 4 * math.sqrt(n * q * (1 - q) / reps)
    assert abs(var / (n * q * (1 - q)) - 1) < 0.15
    # marginal inclusion: chi-square goodness of fit to uniform
    chi = stats.chisquare(counts.numpy())
    assert chi.pvalue > 1e-4


def test_poisson_pairwise_independence():
    n, reps = 4, 20000
    s = PoissonSampler(n, 2.0)  # q = 0.5
    g = torch.Generator().manual_seed(2)
    both = 0
    for _ in range(reps):
        idx = set(s.sample(g).tolist())
        both += (0 in idx) and (1 in idx)
    assert abs(both / reps - 0.25) < 4 * math.sqrt(0.25 * 0.75 / reps)


def test_poisson_empty_batches_happen_and_are_valid():
    s = PoissonSampler(1000, 0.5)
    g = torch.Generator().manual_seed(0)
    sizes = [len(s.sample(g)) for _ in range(50)]
    assert 0 in sizes


def test_fixed_size_exact_and_uniform():
    s = FixedSizeSampler(50, 10)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(50)
    for _ in range(2000):
        idx = s.sample(g)
        assert len(idx) == 10 and len(torch.unique(idx)) == 10
        counts[idx] += 1
    assert stats.chisquare(counts.numpy()).pvalue > 1e-4


def test_samplers_declare_event_and_adjacency():
    p = PoissonSampler(1000, 10.0)
    f = FixedSizeSampler(1000, 10)
    assert p.adjacency == ADD_REMOVE and p.sensitivity_factor == 1
    assert f.adjacency == REPLACE_ONE and f.sensitivity_factor == 2
    assert p.step_event(GaussianEvent(1.0)) == PoissonSampledEvent(0.01, GaussianEvent(1.0))
    assert f.step_event(GaussianEvent(1.0)) == SampledWithoutReplacementEvent(
        1000, 10, GaussianEvent(1.0))
    assert p.steps_per_epoch == 100 and p.sample_rate == 0.01


@pytest.mark.parametrize("b", [0, -1, 2000, math.nan])
def test_sampler_rejects_bad_batch(b):
    with pytest.raises(ValueError, match="batch_size"):
        PoissonSampler(1000, b)


def test_make_sampler_errors():
    with pytest.raises(ValueError, match="valid: poisson, fixed-size"):
        make_sampler("shuffle", 10, 2)
    with pytest.raises(ValueError, match="integer batch_size"):
        make_sampler("fixed-size", 10, 2.5)
