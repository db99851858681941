"""The training room: the mechanism of a private run.

``step`` (one private step: an engine, then the release), ``plan`` (the planned events, the
calibration and the budget), ``sampling`` (who is in a batch), ``units`` (what one clipped row
is), ``private`` (:func:`make_private` for your own model and loop), ``trainer`` (the CLI's
training run), ``checkpoint`` (private checkpoints), ``distributed`` (``torchrun``), and the
optional parts of a step (``averaging``, ``multiplicity``, ``loop_guard``).

Rooms above this one (the CLI, the harness, the search, the audits) import from here; nothing in
here imports them.
"""
