"""The training room: the mechanism of a private run.

``release`` (the one door where a noise std meets data: noise on the sum, one public division,
the strategy's update, the event), ``step`` (one private step: an engine, then the release),
``plan`` (one ``Plan`` for steps and rounds: the planned events, the calibration, the budget and
the emitted-equals-planned check), ``sampling`` (who is in a batch), ``units`` (what one clipped row
is), ``private`` (:func:`make_private` for your own model and loop), ``trainer`` (the CLI's
training run), ``checkpoint`` (private checkpoints), ``distributed`` (``torchrun``), and the
optional parts of a step (``averaging``, ``multiplicity``, ``loop_guard``).

Rooms above this one (the CLI, the harness, the search, the audits) import from here; nothing in
here imports them.
"""
