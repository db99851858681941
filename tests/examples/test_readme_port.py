"""The Opacus port shown in the README is the whole diff between examples/mnist_opacus.py (the Opacus
user's loop) and examples/mnist_dpclip.py: every line that differs is in the README, in order, and
nothing else differs; the README's count of changed lines is the count of that diff. The quick
start at the top of the README runs as printed."""

import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _port_diff() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own model and loop"):]
    block = re.search(r"```diff\n(.*?)```", section, re.S)
    assert block, "the README's own-model section shows the Opacus port as a diff"
    return block.group(1).splitlines()


def _file_diff() -> list[str]:
    a = (ROOT / "examples" / "mnist_opacus.py").read_text().splitlines()
    b = (ROOT / "examples" / "mnist_dpclip.py").read_text().splitlines()
    return [ln for ln in difflib.unified_diff(a, b, n=0, lineterm="")
            if ln[:1] in "+-" and not ln.startswith(("---", "+++"))]


def test_the_readme_diff_is_the_whole_diff_of_the_two_examples():
    shown = [ln for ln in _port_diff() if ln[:1] in "+-"]
    assert shown == _file_diff()


def test_the_stated_changed_line_count_is_the_diffs():
    diff = _port_diff()
    out = sum(1 for ln in diff if ln.startswith("-"))
    into = sum(1 for ln in diff if ln.startswith("+"))
    text = (ROOT / "README.md").read_text()
    assert f"That is {out} lines out and {into} in" in text
    assert f"{out} lines out\nand {into} in" in (ROOT / "docs" / "own_model.md").read_text()


def test_the_opacus_loop_runs_with_opacus(capsys, monkeypatch):
    """examples/mnist_opacus.py is a real Opacus loop (a tiny budget), not a made-up baseline."""
    import runpy
    import sys

    import pytest

    pytest.importorskip("opacus")
    monkeypatch.setattr(sys, "argv", ["mnist_opacus.py", "--dataset", "mnist-5k", "--n-train",
                                      "256", "--epochs", "1", "-b", "64", "--device", "cpu"])
    runpy.run_path(str(ROOT / "examples" / "mnist_opacus.py"), run_name="__main__")
    assert re.search(r"epoch 1: test accuracy [\d.]+, epsilon [\d.]+", capsys.readouterr().out)


def test_the_quick_start_runs_as_printed(capsys):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len([ln for ln in code.splitlines() if ln.strip()]) <= 15
    scope: dict = {}
    exec(compile(code, "README quick start", "exec"), scope)  # noqa: S102 - our own README
    dp = scope["dp"]
    assert dp.steps == dp.total_steps and 0 < dp.epsilon() <= 3.0 + 1e-9
    assert "'epsilon'" in capsys.readouterr().out
