"""torch's recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) as one program in the proof and
in the real run: their time-step cells.

``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` call ``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``
(``torch._VF``). The eager C++ kernel of these composite operations reads the batch size as a plain
integer, so the batch-size proof (:mod:`dpclip.engine.batch_symbol`, which runs the eager C++
composite kernels so that the real run emits the same ATen operations) saw it specialise, and every
recurrent model was refused as "uses the batch size as a Python value". :func:`as_cells` runs them
as torch's own Python decomposition does (``torch._decomp.decompositions``: one input projection
per layer, then one cell per time step), which is symbolic in the batch size; the proof installs it
as the Python kernel of the four ``.input`` overloads (:func:`proof_kernels`), and the real run
under the separability tracer calls it in place of the operation
(:func:`dpclip.engine.separable._fused_rnn`), so both emit the same operations, which the real run
matches one by one against the proof. The per-layer path then replays them for one example at a
time under ``torch.func.vmap`` (the fused operations have no batching rule).

Differences from the eager kernel, all refused rather than approximated: inter-layer dropout in
training (torch's decomposition drops it, which would silently change the model; the proof fails
with :data:`DROPOUT_REFUSED`); the packed ``data`` overloads (``PackedSequence``: the batch is
folded with time there). The MKL-DNN inference path torch's decomposition may choose for float32
LSTMs is never taken (an opaque ``mkldnn_rnn_layer`` operation; the cells are used).

Cost: the cells run as ordinary ATen operations, one small matrix product per time step and layer
(as the eager CPU kernel does), plus Python dispatch and the tracer per operation; the per-layer
path's replay runs them again, forward and backward, under ``vmap`` and the recomputation tracer,
and that dominates: measured on one CPU thread (Embedding 1000x64, LSTM 64->128, T 32), a ghost
step took 2.0-2.8 s at B 64 and 7-11 s at B 256 (the replay about 80-93%, at B 256 two thirds
of it the tracer), against 0.36 s / 0.85 s for engine 'naive' and 0.06 s / 0.10 s without
privacy. Sound and exact, but slower than the per-example loop here; a ghost rule from the
time-step structure (per-example gate gradients against inputs and states, no replay) is the way
to make it fast. On a GPU the traced run uses the cells too (not cuDNN); not measured there.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["DROPOUT_REFUSED", "FIX", "RNN_OPS", "as_cells", "drops", "library_changed",
           "proof_kernels"]

#: what a refusal of a recurrent layer tells the user to do (``vmap`` cannot run the fused
#: kernels: no batching rule for them, and the dispatch falls through to a shape error)
FIX = ("use engine 'naive' (a per-example loop; engine 'vmap' cannot run torch's fused recurrent "
       "kernels)")
DROPOUT_REFUSED = ("a recurrent layer (nn.LSTM, nn.GRU, nn.RNN) with dropout between its layers "
                   "in training is not supported by the ghost engine; set dropout=0 (or apply "
                   "nn.Dropout between single-layer recurrent modules), or " + FIX)

_aten = torch.ops.aten
#: the ``.input`` overloads (``torch.lstm`` etc. as nn.LSTM / nn.GRU / nn.RNN call them)
RNN_OPS = {torch.lstm: _aten.lstm.input, torch.gru: _aten.gru.input,
           torch.rnn_tanh: _aten.rnn_tanh.input, torch.rnn_relu: _aten.rnn_relu.input}


def drops(args: tuple) -> bool:
    """Whether a recurrent call (the ``input`` overload's nine arguments) applies dropout between
    its layers: ``dropout``, ``train`` and ``num_layers`` (args 5, 6, 4)."""
    return bool(args[6]) and bool(args[5]) and args[4] > 1


def _layers(input: Any, hidden: Any, params: Any, has_biases: bool, num_layers: int,
            dropout: float, train: bool, bidirectional: bool, batch_first: bool,
            layer_fn: Any) -> Any:
    """``torch._decomp.decompositions._rnn_helper``, with the dropout refusal."""
    from torch._decomp.decompositions import _rnn_helper

    if drops((None, None, None, None, num_layers, dropout, train)):
        raise RuntimeError(DROPOUT_REFUSED)
    return _rnn_helper(input, hidden, params, has_biases, num_layers, 0.0, False, bidirectional,
                       batch_first, layer_fn)


def _lstm(input: Any, hx: Any, params: Any, has_biases: bool, num_layers: int, dropout: float,
          train: bool, bidirectional: bool, batch_first: bool) -> Any:
    """``torch._decomp.decompositions.lstm_impl`` without its MKL-DNN choice."""
    from torch._decomp.decompositions import gather_params, one_layer_lstm

    if len(hx) != 2:
        raise RuntimeError("lstm expects two hidden states")
    params = gather_params(params, has_biases, hx[0].size(2) != hx[1].size(2))
    hidden = list(zip(hx[0], hx[1]))
    out, final = _layers(input, hidden, params, has_biases, num_layers, dropout, train,
                         bidirectional, batch_first, one_layer_lstm)
    final = list(zip(*final))
    return out, torch.stack(final[0], 0), torch.stack(final[1], 0)


def _cells(cell: Any, input: Any, hx: Any, params: Any, has_biases: bool, num_layers: int,
           dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> Any:
    """``torch._decomp.decompositions.gru_impl`` / ``rnn_tanh_input`` / ``rnn_relu_input``."""
    from torch._decomp.decompositions import gather_params, one_layer_rnn

    params = gather_params(params, has_biases, False)
    out, final = _layers(input, hx.unbind(0), params, has_biases, num_layers, dropout, train,
                         bidirectional, batch_first, partial(one_layer_rnn, hidden_fn=cell))
    return out, torch.stack(final, 0)


def _tanh_cell(i: Any, cur_hidden: Any, ih_weight: Any, ih_bias: Any, hh_weight: Any,
               hh_bias: Any) -> Any:
    """``torch._decomp.decompositions.rnn_cell(torch.tanh)`` (a function of this module, whose
    lookups :func:`library_changed` can follow; the closure's are not named)."""
    return torch.tanh(F.linear(cur_hidden, hh_weight, hh_bias) + i)


def _relu_cell(i: Any, cur_hidden: Any, ih_weight: Any, ih_bias: Any, hh_weight: Any,
               hh_bias: Any) -> Any:
    """``torch._decomp.decompositions.rnn_cell(torch.relu)``."""
    return torch.relu(F.linear(cur_hidden, hh_weight, hh_bias) + i)


def _impls() -> dict[Any, Any]:
    from torch._decomp.decompositions import gru_cell

    return {_aten.lstm.input: _lstm,
            _aten.gru.input: partial(_cells, gru_cell),
            _aten.rnn_tanh.input: partial(_cells, _tanh_cell),
            _aten.rnn_relu.input: partial(_cells, _relu_cell)}


_IMPLS: dict[Any, Any] | None = None


def as_cells(op: Any, args: tuple) -> Any:
    """The recurrent operation ``op`` (an ``.input`` overload) on ``args`` (its nine positional
    arguments), computed by its time-step cells."""
    global _IMPLS
    if _IMPLS is None:
        _IMPLS = _impls()
    return _IMPLS[op](*args)


def proof_kernels() -> list[tuple[Any, Any]]:
    """``(overload, kernel)`` for the proof's Python kernels (installed at the composite and
    autograd keys by :func:`dpclip.engine.batch_symbol._eager_kernels`)."""
    return [(op, partial(_kernel, op)) for op in RNN_OPS.values()]


def _kernel(op: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs:
        args = args + tuple(kwargs[a.name] for a in op._schema.arguments[len(args):])
    return as_cells(op, args)


_LOOKUPS: Any = None


def library_changed() -> str | None:
    """None when every name that :func:`as_cells` and torch's decomposition functions it runs
    look up (``F.linear``, ``torch.cat``, ``Tensor.sigmoid``, ...) is still torch's own object
    (:mod:`dpclip.engine.library_code`), else why not. The separability trace judges the
    recurrent operation as one and ignores the layouts of its intermediate operations
    (``separable._fused_rnn``), so the code that computes it must be the decomposition it trusts:
    a replaced ``F.linear`` that adds the batch mean would otherwise be blessed."""
    global _LOOKUPS
    from dpclip.engine.library_code import _Lookups

    if _LOOKUPS is None or _LOOKUPS.bad is not None:
        from torch._decomp import decompositions as d

        global _IMPLS
        if _IMPLS is None:
            _IMPLS = _impls()
        class _Here(_Lookups):
            # this module's own globals (its functions and constants): dpclip's code, compared
            # by identity on every check like the rest, but not required to be torch's
            def add(self, container: Any, name: str, obj: Any, is_dict: bool, where: str,
                    trusted: bool = False) -> None:
                super().add(container, name, obj, is_dict, where,
                            trusted or container is globals())

        got = _Here()
        fns = [_lstm, _cells, _layers, d._rnn_helper, d.gather_params, d.params_hiddens,
               d.one_layer_lstm, d.lstm_cell, d.one_layer_rnn, d.gru_cell]
        fns += [f.args[0] for f in _IMPLS.values() if isinstance(f, partial)]
        for f in fns:
            if callable(f) and hasattr(f, "__code__"):
                got.follow(f, None, 0)
        # (zip(hx[0], hx[1]) iterates tensors without a GET_ITER of its own)
        got.add(torch.Tensor, "__iter__", torch.Tensor.__dict__.get("__iter__"), False,
                "dpclip.engine.recurrent._lstm")
        _LOOKUPS = got
    return _LOOKUPS.changed()
