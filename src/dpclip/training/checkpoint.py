"""Where private checkpoints live and how they are written, and what a finished run keeps.

A training checkpoint is PRIVATE while the run can still resume: it holds the state of the secret
sampling and noise generators (``private.randomness``: MT19937 runs backwards, so the final state
alone gives every past noise draw of the run, hence the noise-free gradient sums) and a hash of
the training data (``data_fingerprint``). So:

* checkpoints are written owner-only (file ``0600``, directory ``0700``), atomically;
* the harness keeps them under :func:`private_root` of its output directory, a SIBLING of the
  directory that holds the reports (``runs`` -> ``runs-private``), never inside it, so publishing
  the reports directory does not publish them (``$DPCLIP_PRIVATE`` chooses another place);
* a run that has finished (every planned step done, or the budget spent) rewrites its checkpoint
  without the generator state and the data fingerprint (:func:`finished_checkpoint`): what is left
  (model, optimizer, strategy state, ledger, history) is what the run releases anyway, plus the
  optimizer state, which is post-processing of released gradients. Such a checkpoint cannot be
  resumed into more steps; loading it only re-reads the finished run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = ["FINISHED_NOTE", "atomic_private_save", "finished_checkpoint", "make_private_dir",
           "private_root"]

#: what a finished run's checkpoint says it dropped (also printed when it is rewritten)
FINISHED_NOTE = ("run finished: the secret generator state and the data fingerprint were removed "
                 "from the checkpoint (it keeps the model, optimizer, strategy state, ledger and "
                 "history, and can no longer be resumed into more steps)")


def private_root(out_dir: str | os.PathLike) -> Path:
    """The directory for the private files of a harness output directory: ``$DPCLIP_PRIVATE`` if
    set, else ``<out_dir>-private`` beside ``out_dir`` (never inside the published reports)."""
    env = os.environ.get("DPCLIP_PRIVATE")
    if env:
        return Path(env)
    out = Path(out_dir)
    return out.parent / f"{out.name or 'runs'}-private"


def make_private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and its parents) and make ``path`` owner-only (``0700``)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    os.chmod(p, 0o700)
    return p


def atomic_private_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` owner-only (``0600``), atomically: written to ``.tmp`` (created
    ``0600``, never readable by others at any moment), fsync'ed, then ``os.replace``d. Raises
    ``OSError`` (the caller words it); the ``.tmp`` is removed on failure."""
    tmp = path.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an older .tmp with wider permissions
        os.close(fd)
        torch.save(obj, tmp)  # opens the 0600 file for writing: the mode is kept
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def finished_checkpoint(ck: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint a finished run keeps: ``ck`` without the generator states of
    ``private.randomness`` (only its public ``mode`` is kept), without ``data_fingerprint``,
    ``torch_rng`` and the compiled-step count, marked ``finished`` (with :data:`FINISHED_NOTE`)."""
    out = dict(ck)
    private = dict(ck["private"])
    # the mode ("secure" / "reproducible") is public (run summaries say it); the states go
    private["randomness"] = {"mode": dict(private.get("randomness") or {}).get("mode")}
    # the data fingerprint (a hash of the training data: whoever holds the file could confirm
    # which neighbouring dataset was trained on), at both places the checkpoint keeps it (the
    # copy under "private" survived: thirty-second hostile review)
    private.pop("data_fingerprint", None)
    # the count of compiled steps (NON-PRIVATE: the non-empty Poisson batches less one, which a
    # resumed run needs and a finished one does not; review 77 took it out of describe(), the
    # hundred-and-twenty-third found it kept here: 83 % to tell D from D')
    private.pop("engine_compiled_steps", None)
    out["private"] = {**private, "finished": True}
    out.pop("data_fingerprint", None)
    # torch's public generator: before the chunks took their seeds from the run's private key it
    # advanced once per chunk, so its state told the realised batch sizes (eleventh hostile
    # review); nothing after the run needs it
    out.pop("torch_rng", None)
    out["finished"] = True
    out["finished_note"] = FINISHED_NOTE
    return out
