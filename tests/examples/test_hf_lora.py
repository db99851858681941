"""examples/hf_lora.py: LoRA adapters on a frozen tiny Llama through ``make_private`` (issue 31,
item 6): the run is on ghost, the frozen base gets no per-example work, no noise and no update."""

from __future__ import annotations

import runpy

import pytest
import torch

from tests.examples.test_examples import EXAMPLES, run_example

pytest.importorskip("transformers", reason="optional extra: pip install transformers")
pytest.importorskip("peft", reason="optional extra: pip install peft")


def test_lora_example_runs_on_ghost(capsys, monkeypatch):
    out, s = run_example("hf_lora.py", ["--n", "96", "--length", "6", "--epochs", "1",
                                        "--batch-size", "32", "--hidden", "16"],
                         capsys, monkeypatch)
    assert s["engine"] == "ghost" and s["engine_requested"] == "auto"
    assert s["engine_fallback"] is None and s["engine_per_layer"] is None
    assert s["steps"] == s["planned_steps"] > 0 and s["randomness"] == "secure"
    assert "trainable (LoRA)" in out


def test_lora_frozen_base_gets_nothing(monkeypatch):
    """Only the adapters are hooked, noised and updated; the frozen base is untouched."""
    import dpclip.engine.ghost as ghost_mod
    import dpclip.training.release as release_mod  # the one door that draws the noise
    from dpclip.training.private import make_private

    ex = runpy.run_path(str(EXAMPLES / "hf_lora.py"))
    model = ex["build"](32, 16, 1, 2, 2, 0)
    ids = ex["synthetic"](64, 6, 32, 0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    hooked, noised = set(), []
    real_call, real_noise = ghost_mod._Call.__init__, release_mod.add_gaussian_noise_all

    def spy_call(self, owner, a, out, tracer=None):
        hooked.add(owner.name)
        real_call(self, owner, a, out, tracer)

    def spy_noise(values, std, generator, divide_by=1.0, **kw):
        noised.append(sorted(values))
        return real_noise(values, std, generator, divide_by, **kw)

    monkeypatch.setattr(ghost_mod._Call, "__init__", spy_call)
    monkeypatch.setattr(release_mod, "add_gaussian_noise_all", spy_noise)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    dp = make_private(model, opt, (ex["model_inputs"](ids), ids), loss_fn=ex["loss_fn"],
                      strategy="fixed", strategy_params={"clip_norm": 1.0},
                      noise_multiplier=1.0, steps=2, batch_size=16, engine="auto",
                      verbose=False)
    for xb, yb in dp.loader:
        dp.step(xb, yb)
    assert dp.engine_info["engine"] == "ghost" and dp.engine_info["fallback"] is None
    assert hooked and all("lora_" in name for name in hooked)
    assert noised and all(set(names) == trainable for names in noised)
    for n, p in model.named_parameters():
        if n in frozen:
            assert p.grad is None and torch.equal(p.detach(), frozen[n]), n
    assert any(not torch.equal(p.detach(), lora[n]) for n, p in model.named_parameters()
               if n in lora)
