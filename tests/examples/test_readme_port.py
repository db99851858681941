"""The Opacus port shown in the README is the code of examples/mnist_dpclip.py, and the README's
count of changed lines is the count of its diff."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _port_diff() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own model and loop"):]
    block = re.search(r"```diff\n(.*?)```", section, re.S)
    assert block, "the README's own-model section shows the Opacus port as a diff"
    return block.group(1).splitlines()


def test_every_added_line_is_in_the_example():
    example = (ROOT / "examples" / "mnist_dpclip.py").read_text()
    added = [ln[1:].strip() for ln in _port_diff() if ln.startswith("+")]
    assert added
    for line in added:
        assert line in example, f"README port line not in examples/mnist_dpclip.py: {line!r}"
    kept = [ln[1:].strip() for ln in _port_diff() if ln.startswith(" ") and ln.strip() != "..."]
    for line in kept:
        assert line in example, f"README context line not in examples/mnist_dpclip.py: {line!r}"


def test_the_stated_changed_line_count_is_the_diffs():
    diff = _port_diff()
    out = sum(1 for ln in diff if ln.startswith("-"))
    into = sum(1 for ln in diff if ln.startswith("+"))
    text = (ROOT / "README.md").read_text()
    assert f"That is {out} lines out and {into} in" in text
    assert f"{out} lines out and {into} in" in (ROOT / "docs" / "own_model.md").read_text()
