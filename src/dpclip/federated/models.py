"""Models of the federated benchmarks (Andrew et al. 2021, Sec. 4, after Reddi et al. 2021).

* ``emnist-cnn``: the EMNIST character-recognition CNN: conv 3x3 (32) - ReLU - conv 3x3 (64) -
  ReLU - max-pool 2 - dropout 0.25 - dense 128 - ReLU - dropout 0.5 - dense ``num_classes``.
* ``char-lstm``: Shakespeare next-character model: embedding 8 - LSTM 256 x 2 - dense vocab.
* ``word-lstm``: Stack Overflow next-word model: embedding 96 - LSTM 670 - dense 96 - dense vocab.

The language models take token ids ``(n, L)`` and return logits ``(n, vocab, L)`` (the class
dimension second, as ``torch.nn.functional.cross_entropy`` expects for sequences). None has
buffers (only parameters are aggregated). Sizes are options, e.g. ``hidden=32`` for tests.
``build_federated_model`` also builds every ``dpclip.models`` name.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

from dpclip.errors import unknown_name

__all__ = ["FEDERATED_MODELS", "SequenceLSTM", "build_federated_model", "emnist_cnn"]


def emnist_cnn(input_shape: tuple[int, ...], num_classes: int, *, channels: tuple[int, int] = (32, 64),
               hidden: int = 128, dropout: tuple[float, float] = (0.25, 0.5)) -> nn.Module:
    c, h, w = input_shape
    flat = channels[1] * ((h - 4) // 2) * ((w - 4) // 2)
    return nn.Sequential(
        nn.Conv2d(c, channels[0], 3), nn.ReLU(), nn.Conv2d(channels[0], channels[1], 3), nn.ReLU(),
        nn.MaxPool2d(2), nn.Dropout(dropout[0]), nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(),
        nn.Dropout(dropout[1]), nn.Linear(hidden, num_classes))


class SequenceLSTM(nn.Module):
    """Embedding - LSTM - (dense projection) - dense vocabulary, per position."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int = 1,
                 projection: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.proj = nn.Linear(hidden, projection) if projection else None
        self.out = nn.Linear(projection or hidden, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        h, _ = self.lstm(self.embed(tokens))
        if self.proj is not None:
            h = self.proj(h)
        return self.out(h).transpose(1, 2)  # (n, vocab, L)


def char_lstm(input_shape: tuple[int, ...], num_classes: int, *, embed: int = 8,
              hidden: int = 256, layers: int = 2) -> nn.Module:
    return SequenceLSTM(num_classes, embed, hidden, layers)


def word_lstm(input_shape: tuple[int, ...], num_classes: int, *, embed: int = 96,
              hidden: int = 670, projection: int = 96) -> nn.Module:
    return SequenceLSTM(num_classes, embed, hidden, 1, projection)


FEDERATED_MODELS: dict[str, Callable[..., nn.Module]] = {
    "emnist-cnn": emnist_cnn, "char-lstm": char_lstm, "word-lstm": word_lstm,
}


def build_federated_model(name: str, input_shape: tuple[int, ...], num_classes: int,
                          **options: Any) -> nn.Module:
    """A federated benchmark model (:data:`FEDERATED_MODELS`) or any ``dpclip.models`` model."""
    from dpclip.models import MODELS, build_model

    if name in FEDERATED_MODELS:
        opts = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
        try:
            return FEDERATED_MODELS[name](tuple(input_shape), int(num_classes), **opts)
        except TypeError as exc:
            raise ValueError(f"model {name!r}: {exc}") from None
    if name in MODELS:
        return build_model(name, input_shape, num_classes, **options)
    raise ValueError(unknown_name("model", name, [*FEDERATED_MODELS, *MODELS]))
