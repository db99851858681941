"""Hugging Face ``transformers`` models: the recipe in the message when the per-example engines
cannot run one as it was called.

A transformers model called the ordinary way (``model(**tokenizer(texts, padding=True,
return_tensors="pt"))``) builds its attention mask from the 2-D ``attention_mask`` and decides in
Python whether ANY row of the batch has padding (``mask.all()``) or, since transformers 5.25, when
``position_ids`` come without an attention mask, whether any row packs several sequences
(``masking_utils.find_packed_sequence_indices``), and its default ``sdpa``
attention runs operations the separability check has no rule for. Neither the ghost engine (the
decision reads other examples' data) nor vmap (no data-dependent Python control flow) can run that.
:func:`with_hf_recipe` turns the engines' long message into a short one that names the model and
gives the recipe (``examples/hf_sequence_classifier.py`` follows it).

Privacy: none (a message).
"""

from __future__ import annotations

import traceback
from typing import Any

from torch import nn

from dpclip._ident import ident

__all__ = ["HF_RECIPE", "is_transformers_model", "with_hf_recipe"]

HF_RECIPE = (
    "load the model with attn_implementation=\"eager\", and give each example its own tensors: "
    "the attention mask as a 4-D additive (B, 1, 1, T) float mask (0 where attended, "
    "torch.finfo(dtype).min at padding) instead of the tokenizer's 2-D one, and position_ids / "
    "token_type_ids as (B, T) tensors; examples/hf_sequence_classifier.py builds them "
    "(model_inputs) and trains on the ghost engine. Or use engine='naive' (a per-example loop, "
    "slow)")


def is_transformers_model(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith("transformers.") for m in model.modules())


def _from_transformers(exc: BaseException) -> bool:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and ident(e) not in seen:
        seen.add(ident(e))
        if any("transformers" in f.filename for f in traceback.extract_tb(e.__traceback__)):
            return True
        e = e.__cause__ or e.__context__
    return False


def with_hf_recipe(exc: BaseException, model: nn.Module) -> BaseException | None:
    """A shorter error of the same type with the transformers recipe, when ``exc`` (an engine's
    refusal) comes from a transformers model's forward; else None."""
    if not (is_transformers_model(model) or _from_transformers(exc)):
        return None
    first = str(exc)
    short = first if len(first) <= 240 else first[:first.rfind(" ", 0, 240)] + " ..."
    name = type(model).__name__
    args: Any = (f"{name} (Hugging Face transformers) cannot be run per example as it was called "
                 f"({short}). transformers decides in Python whether any row of the batch has "
                 f"padding or (position_ids without a mask) packs sequences, and its default "
                 f"attention has no per-example rule. Recipe: {HF_RECIPE}",)
    try:
        new = type(exc)(*args)
    except Exception:  # noqa: BLE001 - an exception type with another signature
        return None
    return new
