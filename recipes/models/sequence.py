"""Sequence models: an LSTM video classifier and a Transformer encoder-decoder for translation."""

from __future__ import annotations

import math

import torch
from torch import nn

from recipes.errors import RecipeConfigError, check_float, check_int


class LSTMClassifier(nn.Module):
    """Per-frame features -> LSTM -> the last valid hidden state -> class logits (padding is skipped)."""

    def __init__(self, feature_dim: int, num_classes: int, hidden_size: int = 512, num_layers: int = 1,
                 dropout: float = 0.0) -> None:
        super().__init__()
        check_int(feature_dim, "model.feature_dim", minimum=1)
        check_int(hidden_size, "model.hidden_size", minimum=1)
        check_int(num_layers, "model.num_layers", minimum=1)
        check_float(dropout, "model.dropout", minimum=0.0, maximum=1.0)
        self.lstm = nn.LSTM(feature_dim, hidden_size, num_layers=num_layers, batch_first=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden_size, check_int(num_classes, "model.num_classes", minimum=2))

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(features, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (hidden, _) = self.lstm(packed)
        return self.head(self.dropout(hidden[-1]))


def sinusoidal_positions(length: int, dim: int, device: torch.device) -> torch.Tensor:
    """The Transformer's fixed position encodings ``[length, dim]`` (computed, not a buffer)."""
    position = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
    scale = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    enc = torch.zeros(length, dim, device=device)
    enc[:, 0::2] = torch.sin(position * scale)
    enc[:, 1::2] = torch.cos(position * scale[: dim // 2])
    return enc


class Seq2SeqTransformer(nn.Module):
    """Transformer encoder-decoder (Vaswani et al. 2017): embeddings, sinusoidal positions, pre-norm layers.

    ``forward(src, tgt_in)`` returns logits ``[B, T, tgt_vocab]``; 0 is the padding id.
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 512, nhead: int = 8,
                 num_encoder_layers: int = 6, num_decoder_layers: int = 6, dim_feedforward: int = 2048,
                 dropout: float = 0.1, max_positions: int = 512) -> None:
        super().__init__()
        check_int(src_vocab_size, "model.src_vocab_size", minimum=5)
        check_int(tgt_vocab_size, "model.tgt_vocab_size", minimum=5)
        check_int(d_model, "model.d_model", minimum=2)
        check_int(nhead, "model.nhead", minimum=1)
        if d_model % nhead or d_model % 2:
            raise RecipeConfigError("model.d_model", f"must be even and divisible by model.nhead ({nhead}), "
                                                     f"got {d_model}")
        check_int(num_encoder_layers, "model.num_encoder_layers", minimum=1)
        check_int(num_decoder_layers, "model.num_decoder_layers", minimum=1)
        check_int(dim_feedforward, "model.dim_feedforward", minimum=1)
        check_float(dropout, "model.dropout", minimum=0.0, maximum=1.0)
        self.d_model = d_model
        self.max_positions = check_int(max_positions, "model.max_positions", minimum=2)
        self.src_embed = nn.Embedding(src_vocab_size, d_model, padding_idx=0)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, d_model, padding_idx=0)
        enc = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, batch_first=True, norm_first=True)
        dec = nn.TransformerDecoderLayer(d_model, nhead, dim_feedforward, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, num_encoder_layers, norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(dec, num_decoder_layers, norm=nn.LayerNorm(d_model))
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(d_model, tgt_vocab_size)

    def _embed(self, embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.max_positions:
            raise ValueError(f"sequence of {ids.shape[1]} tokens exceeds model.max_positions ({self.max_positions})")
        x = embedding(ids) * math.sqrt(self.d_model)
        return self.dropout(x + sinusoidal_positions(ids.shape[1], self.d_model, ids.device))

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        src_pad, tgt_pad = src.eq(0), tgt_in.eq(0)
        steps = tgt_in.shape[1]  # True above the diagonal: a position does not attend to later ones
        causal = torch.ones(steps, steps, dtype=torch.bool, device=src.device).triu(1)
        memory = self.encoder(self._embed(self.src_embed, src), src_key_padding_mask=src_pad)
        out = self.decoder(self._embed(self.tgt_embed, tgt_in), memory, tgt_mask=causal, tgt_is_causal=True,
                           tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
        return self.head(out)
