"""What `dpclip audit` prints (issue 35): each number named, the one-step white-box claim not
read as a contradiction of the run's epsilon, THE bound marked, PASS/FAIL; no "mislabelled"
canaries in `dpclip --help`."""

from __future__ import annotations

from dpclip.cli import build_parser, main


def test_whitebox_output_names_each_number(tmp_path, capsys):
    rc = main(["audit", "--strategy", "fixed", "--epsilon", "2", "--dataset", "synthetic",
               "--epochs", "2", "--batch-size", "64", "--delta", "1e-4", "--canaries", "400",
               "--db", str(tmp_path / "r.db"), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "one-step claim:          epsilon " in out
    assert "without the amplification of sampling" in out
    assert "the run's epsilon:       2  (all steps, with sampling amplification" in out
    assert "<- THE bound compared with the claim (the largest of: one-run " in out
    assert "gaussian fit" in out
    assert "verdict: PASS (no violation found)" in out


def test_help_does_not_say_mislabelled():
    text = build_parser().format_help()
    assert "mislabelled" not in text
