"""Translation pairs: parallel text files (WMT-style), or built-in token pairs with a deterministic mapping.

**Real format** (``data_dir`` set): two aligned plain-text files per split,
``<prefix>.<lang>``, UTF-8, one sentence per line, line ``i`` of the source
file translating line ``i`` of the target file, tokens separated by white space
(pre-tokenised or BPE-segmented text, as Transformer WMT set-ups prepare it):

```
data_dir/train.en  data_dir/train.de      # --data.src_lang en --data.tgt_lang de
data_dir/valid.en  data_dir/valid.de      # --data.train_prefix / --data.val_prefix
```

The vocabularies are built from the training files (tokens seen at least
``min_freq`` times, the ``max_vocab`` most frequent), identically on every rank;
unknown tokens map to ``<unk>``; sentences are cut to ``max_len`` tokens; pairs
with an empty side are skipped.

**Built-in** (``data_dir`` unset): source sentences of random tokens (length
``min_len..max_len``), target = a fixed random permutation of the vocabulary
applied token by token (reversed with ``reverse=True``): a deterministic
mapping that a model must learn both per token and by position.

Ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>``. Batches:
``(src [B, S], tgt [B, T])`` padded with 0; ``src`` ends with ``<eos>``, ``tgt``
is ``<bos> ... <eos>``.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from recipes.data.base import BuiltinSamples, RecipeDataModule
from recipes.errors import RecipeConfigError, check_int, require_file

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


class Vocab:
    """Token <-> id, the special tokens first; built from token counts, the same on every rank."""

    def __init__(self, tokens: list[str]) -> None:
        self.itos = list(SPECIALS) + [t for t in tokens if t not in SPECIALS]
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    @classmethod
    def build(cls, counts: Counter[str], min_freq: int = 1, max_size: Optional[int] = None) -> "Vocab":
        """The tokens seen at least ``min_freq`` times, most frequent first (ties by token), at most ``max_size``."""
        ordered = sorted((t for t, n in counts.items() if n >= min_freq), key=lambda t: (-counts[t], t))
        return cls(ordered[:max_size] if max_size is not None else ordered)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: list[str]) -> list[int]:
        return [self.stoi.get(t, UNK) for t in tokens]


def read_lines(path: Path) -> list[list[str]]:
    """The white-space tokens of every line of a UTF-8 text file (an error naming ``data.data_dir`` if it is not)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.split() for line in f]
    except UnicodeDecodeError as err:
        raise RecipeConfigError("data.data_dir", f"{str(path)!r} is not UTF-8 text (byte {err.start}: {err.reason}): "
                                                 "expected one tokenised sentence per line") from None


def read_parallel(src: Path, tgt: Path) -> list[tuple[list[str], list[str]]]:
    """Aligned token pairs of two text files; errors if their line counts differ."""
    src_lines, tgt_lines = read_lines(src), read_lines(tgt)
    if len(src_lines) != len(tgt_lines):
        raise RecipeConfigError("data.data_dir", f"{str(src)!r} has {len(src_lines)} lines but {str(tgt)!r} has "
                                                 f"{len(tgt_lines)}: parallel files must be aligned line by line")
    pairs = [(s, t) for s, t in zip(src_lines, tgt_lines) if s and t]
    if len(pairs) < len(src_lines):
        log.info("%s: skipped %d pairs with an empty side", src.name, len(src_lines) - len(pairs))
    if not pairs:
        raise RecipeConfigError("data.data_dir", f"{str(src)!r} / {str(tgt)!r} hold no sentence pair")
    return pairs


class TokenPairs(Dataset):
    """Encoded sentence pairs: ``(src ids + <eos>, <bos> + tgt ids + <eos>)`` as int64 tensors."""

    def __init__(self, pairs: list[tuple[list[str], list[str]]], src_vocab: Vocab, tgt_vocab: Vocab,
                 max_len: int) -> None:
        self.pairs, self.src_vocab, self.tgt_vocab, self.max_len = pairs, src_vocab, tgt_vocab, max_len

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        src, tgt = self.pairs[index]
        s = self.src_vocab.encode(src[: self.max_len]) + [EOS]
        t = [BOS] + self.tgt_vocab.encode(tgt[: self.max_len]) + [EOS]
        return torch.tensor(s, dtype=torch.int64), torch.tensor(t, dtype=torch.int64)


class MappedTokens(BuiltinSamples):
    """Built-in pairs: random source tokens, target = a fixed permutation of them (module docstring)."""

    def __init__(self, num_samples: int, *, vocab_size: int, min_len: int, max_len: int, reverse: bool = False,
                 seed: int = 0, split: int = 0) -> None:
        super().__init__(num_samples, seed, split)
        self.vocab_size, self.min_len, self.max_len, self.reverse = vocab_size, min_len, max_len, reverse
        g = torch.Generator().manual_seed(seed)
        content = len(SPECIALS) + torch.randperm(vocab_size - len(SPECIALS), generator=g)
        self.mapping = torch.cat([torch.arange(len(SPECIALS)), content])  # specials map to themselves

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.generator(index)
        length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=g))
        src = torch.randint(len(SPECIALS), self.vocab_size, (length,), generator=g)
        tgt = self.mapping[src]
        if self.reverse:
            tgt = tgt.flip(0)
        eos, bos = torch.tensor([EOS]), torch.tensor([BOS])
        return torch.cat([src, eos]), torch.cat([bos, tgt, eos])


def pad_pairs(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``collate_fn``: pads sources and targets with ``<pad>`` (0) to the longest of the batch."""
    pad = torch.nn.utils.rnn.pad_sequence
    return (pad([s for s, _ in samples], batch_first=True, padding_value=PAD),
            pad([t for _, t in samples], batch_first=True, padding_value=PAD))


class ParallelTextDataModule(RecipeDataModule):
    """Parallel text files (``data_dir``, see the module docstring) or built-in mapped token pairs.

    Args:
        src_lang, tgt_lang: the files' language suffixes (``train.en``, ``train.de``).
        train_prefix, val_prefix: the files' split prefixes.
        max_len: longest sentence in tokens (longer ones are cut; built-in: the longest generated).
        min_len: built-in: the shortest sentence.
        min_freq, max_vocab: vocabulary building (real data).
        synthetic_vocab: built-in vocabulary size (specials included).
        reverse: built-in data: the target reversed.
        (the other options, the built-in data set sizes and seed among them: see ``RecipeDataModule``)
    """

    data_dir_hint = "it must hold aligned text files <train_prefix>.<src_lang> and <train_prefix>.<tgt_lang>"
    collate_fn = staticmethod(pad_pairs)

    def __init__(self, *, batch_size: int = 64, src_lang: str = "en", tgt_lang: str = "de",
                 train_prefix: str = "train", val_prefix: str = "valid", max_len: int = 100, min_len: int = 4,
                 min_freq: int = 1, max_vocab: Optional[int] = 32_000, synthetic_vocab: int = 64,
                 reverse: bool = False, **kwargs: Any) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        self.min_len, self.max_len = self._lengths("min_len", min_len, "max_len", max_len)
        self.min_freq = check_int(min_freq, "data.min_freq", minimum=1)
        self.max_vocab = check_int(max_vocab, "data.max_vocab", minimum=1) if max_vocab is not None else None
        self.synthetic_vocab = check_int(synthetic_vocab, "data.synthetic_vocab", minimum=len(SPECIALS) + 2)
        self.reverse = reverse
        self.src_vocab: Optional[Vocab] = None
        self.tgt_vocab: Optional[Vocab] = None
        self._pairs: dict[str, list[tuple[list[str], list[str]]]] = {}
        if self.data_dir is not None:
            for split, prefix in (("train", train_prefix), ("val", val_prefix)):
                src = require_file(self.data_dir / f"{prefix}.{src_lang}", "data.data_dir", f"the {split} source file")
                tgt = require_file(self.data_dir / f"{prefix}.{tgt_lang}", "data.data_dir", f"the {split} target file")
                self._pairs[split] = read_parallel(src, tgt)
            train = self._pairs["train"]
            self.src_vocab = Vocab.build(Counter(t for s, _ in train for t in s), self.min_freq, self.max_vocab)
            self.tgt_vocab = Vocab.build(Counter(t for _, s in train for t in s), self.min_freq, self.max_vocab)

    @property
    def src_vocab_size(self) -> int:
        """Source vocabulary size (linked to ``model.src_vocab_size``)."""
        return self.synthetic_vocab if self.src_vocab is None else len(self.src_vocab)

    @property
    def tgt_vocab_size(self) -> int:
        """Target vocabulary size (linked to ``model.tgt_vocab_size``)."""
        return self.synthetic_vocab if self.tgt_vocab is None else len(self.tgt_vocab)

    @property
    def max_positions(self) -> int:
        """Longest sequence the model sees (``max_len`` + 2 specials; linked to ``model.max_positions``)."""
        return self.max_len + 2

    def _build(self) -> tuple[Dataset, Dataset]:
        if self.data_dir is None:
            common = dict(vocab_size=self.synthetic_vocab, min_len=self.min_len, max_len=self.max_len,
                          reverse=self.reverse, seed=self.seed)
            return (MappedTokens(self.synthetic_train_samples, split=0, **common),
                    MappedTokens(self.synthetic_val_samples, split=1, **common))
        assert self.src_vocab is not None and self.tgt_vocab is not None
        return (TokenPairs(self._pairs["train"], self.src_vocab, self.tgt_vocab, self.max_len),
                TokenPairs(self._pairs["val"], self.src_vocab, self.tgt_vocab, self.max_len))
