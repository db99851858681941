"""Run the strategy contract over every registered strategy."""

import pytest

from dpclip.clipping import STRATEGIES
from tests.clipping.contract import ALL_CHECKS, contract_strategy


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_contract(name, check):
    check(contract_strategy(name))
