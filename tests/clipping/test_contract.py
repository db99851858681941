"""Run the strategy contract over every registered strategy."""

import pytest

from dpclip.clipping import STRATEGIES
from tests.clipping.contract import ALL_CHECKS, contract_strategy


_BOUND_SKIP = pytest.mark.skip(
    reason="bound-based strategy (sensitivity certified from the model, no per-example weights); "
    "its contract is tests/lipschitz/test_algorithm.py"
)
NAMES = [
    pytest.param(n, marks=_BOUND_SKIP) if STRATEGIES[n].kind == "bound" else n
    for n in sorted(STRATEGIES)
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_contract(name, check):
    check(contract_strategy(name))
