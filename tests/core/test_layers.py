"""The house rule, written once: which room of ``src/dpclip`` may import which (issue 34).

A room is a subpackage (``dpclip.engine``) or a top-level module (``dpclip.noise``). Every import
in ``src/`` is read from the AST, those inside functions included (a function-level import hides
the graph from readers, not from this test), plus ``importlib.import_module("dpclip...")`` calls.
The test fails on:

- an import from one room into a room that is not in its allowed set (an upward import),
- a room missing from :data:`ROOMS` (a new room must be placed in the house),
- a circle between modules (within a room too), counting the package ``__init__`` a module's
  import runs first,
- a rule that itself has a circle.

Each message names the import (file and line) and the rule it breaks.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Bottom to top. Each room lists the rooms it may import (directly); anything else is upward.
_LEAVES = {"events", "errors", "_checks", "_ident", "devices", "runtime", "published", "store",
           "blas_mode"}
_BASE = {"events", "errors", "_checks", "_ident"}
ROOMS: dict[str, set[str]] = {
    # leaves: import nothing from dpclip
    **{name: set() for name in _LEAVES - {"errors"}},
    "errors": set(),
    "registry": {"errors"},
    "randomness": {"devices"},
    "noise": {"randomness", "devices"},
    "accounting": _BASE,
    "interrupts": _BASE,
    "lr_schedules": _BASE,
    "hf": _BASE,
    # the leaf rooms of the mechanism: each with a protocol, none imports another
    "clipping": _BASE | {"registry"},
    "engine": _BASE | {"registry", "devices"},
    "data": _BASE | {"registry", "devices"},
    "models": _BASE | {"registry"},
    # above clipping and models: bound-based strategies and Lipschitz networks register there
    "lipschitz": _BASE | {"clipping", "models", "registry"},
    "inputs": _BASE | {"engine"},
    "diagnostics": _BASE | {"clipping", "engine"},
    # the mechanism: one room over the leaf rooms
    "training": _BASE | {"accounting", "clipping", "engine", "data", "models", "noise",
                         "randomness", "devices", "diagnostics", "inputs", "interrupts",
                         "lr_schedules", "hf", "registry", "lipschitz", "blas_mode"},
    "model_check": _BASE | {"clipping", "engine", "training"},
    # applications of the mechanism
    "audit": _BASE | {"accounting", "clipping", "data", "engine", "noise", "randomness",
                      "training", "models"},
    "federated": _BASE | {"accounting", "clipping", "data", "models", "noise", "randomness",
                          "training", "store", "devices", "engine"},
    "search": _BASE | {"accounting", "clipping", "data", "engine", "models", "noise",
                       "randomness", "training", "store", "devices"},
    "bench": _BASE | {"clipping", "engine", "models", "noise", "training", "devices",
                      "runtime", "hf"},
    "bench_plot": _BASE | {"bench"},
    "harness": _BASE | {"accounting", "audit", "clipping", "data", "federated", "interrupts",
                        "models", "search", "store", "training", "devices", "published"},
    # the top: command line and demo
    "cli": None,  # may import every room below it (nothing imports it)
    "demo": {"cli", "runtime"},
    "__main__": {"cli"},
}
_TOP = {"cli", "demo", "__main__"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "dpclip").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _targets(module: str, node: ast.AST, is_pkg: bool, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")[: len(module.split(".")) - (0 if is_pkg else 1)]
            base = base[: len(base) - (node.level - 1)]
            pkg = ".".join(base + ([node.module] if node.module else []))
        else:
            pkg = node.module or ""
        subs = [f"{pkg}.{a.name}" for a in node.names if f"{pkg}.{a.name}" in modules]
        # ``from pkg import submodule`` needs the submodule; any other name needs pkg's __init__
        names = subs if len(subs) == len(node.names) else [pkg, *subs]
    elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
          and node.args and isinstance(node.args[0], ast.Constant)):
        names = [str(node.args[0].value)]
    else:
        return []
    out = []
    for name in names:
        if not name.startswith("dpclip"):
            continue
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules and name != module:
            out.append(name)
    return out


def import_graph() -> dict[str, list[tuple[str, int]]]:
    """``module -> [(imported module, line)]`` for every dpclip import in src/ (AST walk)."""
    modules = _modules()
    graph: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            for target in _targets(module, node, path.name == "__init__.py", modules):
                graph[module].append((target, node.lineno))
    return graph


def _where(module: str, line: int) -> str:
    return f"{_modules()[module].relative_to(SRC.parent)}:{line}"


def upward_imports(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    errors = []
    for module, targets in sorted(graph.items()):
        src = _room(module)
        if not src:  # dpclip/__init__.py: the facade re-exports every room
            continue
        for target, line in targets:
            dst = _room(target)
            if not dst or dst == src:
                continue
            allowed = ROOMS.get(src)
            if allowed is None and src in ROOMS:  # the command line may import everything
                continue
            if allowed is None or dst not in allowed:
                errors.append(f"{_where(module, line)}: {module} imports {target}, but room "
                              f"{src!r} may import only {sorted(allowed or ())} "
                              "(tests/core/test_layers.py ROOMS)")
    return errors


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan, iterative enough for a ~150-module graph
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]


def module_circles(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Circles between modules. Importing ``a.b.c`` first runs the package ``a.b``: that edge
    counts, except towards the importer's own packages (a package importing its submodules)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        if module == "dpclip":
            continue
        own = {".".join(module.split(".")[:i]) for i in range(1, len(module.split(".")))}
        for target, _ in targets:
            edges[module].add(target)
            parts = target.split(".")
            for i in range(2, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg not in own:
                    edges[module].add(pkg)
    errors = []
    for comp in _sccs(edges):
        members = set(comp)
        lines = [f"{_where(m, line)}: {m} imports {t}" for m in comp
                 for t, line in graph.get(m, ()) if t in members]
        errors.append("import circle between " + ", ".join(comp) + ":\n  " + "\n  ".join(lines))
    return errors


def test_the_rule_itself_has_no_circle_and_names_known_rooms() -> None:
    rule = {r: (set(ROOMS) - _TOP if allowed is None else allowed) for r, allowed in ROOMS.items()}
    unknown = {r: sorted(a - set(ROOMS)) for r, a in rule.items() if a - set(ROOMS)}
    assert not unknown, f"ROOMS names rooms that do not exist in the rule: {unknown}"
    assert not _sccs({r: a - {r} for r, a in rule.items()}), "the rule has a circle"


def test_every_room_is_placed() -> None:
    rooms = {_room(m) for m in _modules()} - {""}
    missing = sorted(rooms - set(ROOMS))
    assert not missing, (f"room(s) {missing} are not placed in tests/core/test_layers.py ROOMS: "
                         "add each with the rooms it may import")


def test_no_upward_import_between_rooms() -> None:
    errors = upward_imports(import_graph())
    assert not errors, "upward import(s):\n" + "\n".join(errors)


def test_no_import_circle_between_modules() -> None:
    errors = module_circles(import_graph())
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("src, dst", [("clipping", "lipschitz"), ("engine", "training"),
                                      ("harness", "cli"), ("search", "harness"),
                                      ("models", "lipschitz"), ("federated", "harness")])
def test_the_circles_of_issue_34_stay_forbidden(src: str, dst: str) -> None:
    """Each import that closed a circle of issue 34 is refused by the rule and reported."""
    assert ROOMS[src] is not None and dst not in ROOMS[src], f"{src} -> {dst} is allowed"


def test_a_planted_circle_and_upward_import_are_reported(tmp_path: Path) -> None:
    """The checks see function-level imports and importlib calls (attack: hide the import)."""
    graph = {"dpclip.clipping.registry": [("dpclip.lipschitz.strategy", 7)],
             "dpclip.lipschitz.strategy": [("dpclip.clipping.registry", 3)]}
    circles = _sccs({m: {t for t, _ in ts} for m, ts in graph.items()})
    assert circles == [["dpclip.clipping.registry", "dpclip.lipschitz.strategy"]]
    code = ("def f():\n    import importlib\n    importlib.import_module('dpclip.lipschitz')\n"
            "def g():\n    from dpclip.cli import main\n")
    tree = ast.parse(code)
    modules = _modules()
    found = {t for node in ast.walk(tree)
             for t in _targets("dpclip.clipping.registry", node, False, modules)}
    assert found == {"dpclip.lipschitz", "dpclip.cli"}
