"""Run the strategy contract over every registered strategy."""

import pytest

from dpclip.clipping import STRATEGIES
from dpclip.clipping.capabilities import Capabilities, capabilities_of, check_capabilities
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


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_declares_its_capabilities(name):
    """Capabilities are declared once, on the strategy, and agree with its hooks and kind."""
    strategy = contract_strategy(name)
    assert check_capabilities(strategy) == []
    assert capabilities_of(strategy) is strategy.capabilities
    assert capabilities_of(strategy).bound_based == (STRATEGIES[name].kind == "bound")


def test_capability_checks_catch_a_false_declaration():
    """Attacks on the check: a declared capability without its hooks, a kind that disagrees, no
    declaration at all; and the one legacy reading of an undeclared user strategy."""
    from dpclip.clipping import FixedClip

    class NoHooks(FixedClip):
        capabilities = Capabilities(public_norms=True)

    assert check_capabilities(NoHooks(1.0)) == ["declares public_norms but has no 'public_refresh'"]

    class WrongKind(FixedClip):
        capabilities = Capabilities(per_group=True)

    assert any("norm_kind" in p for p in check_capabilities(WrongKind(1.0)))

    class Legacy:  # a user's strategy from before capabilities: read from its old attributes
        name = "legacy"
        needs_per_example_grads = True

    assert check_capabilities(Legacy()) == ["declares no Capabilities value (got None)"]
    assert capabilities_of(Legacy()) == Capabilities(per_example_grads=True)
    class KindOnly(FixedClip):  # sets kind but inherits the plain declaration: read as bound
        kind = "bound"

    assert capabilities_of(KindOnly(1.0)).bound_based
    assert any("kind" in p for p in check_capabilities(KindOnly(1.0)))
    from dpclip.clipping.schedules import DuDynamic

    assert capabilities_of(DuDynamic) == Capabilities()  # a wrapper class: known per instance
    with pytest.raises(ValueError, match="bound-based"):
        Capabilities(bound_based=True, per_group=True)
    with pytest.raises(TypeError, match="per_group must be a bool"):
        Capabilities(per_group=1)
