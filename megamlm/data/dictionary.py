"""megamlm's id convention, which every tokenizer maps into: fairseq's dictionary.

    <s>=0 <pad>=1 </s>=2 <unk>=3, then the vocabulary's symbols, `<mask>` last

Data, masking, models and converters rely on these ids alone (data/tokenizer.py: GPT-2 BPE through
fairseq's dict.txt; data/pieces.py: WordPiece and SentencePiece vocabularies with their specials
moved to these places).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megamlm.errors import MegamlmError
from megamlm.files import read_text

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BOS, PAD, EOS, UNK = range(4)
MASK_SYMBOL = "<mask>"


class TokenizerError(MegamlmError):
    """A tokenizer or dictionary file is missing, corrupt or inconsistent."""


@dataclass(frozen=True)
class Dictionary:
    """fairseq Dictionary: 4 specials, the dict.txt symbols, optionally `<mask>` last."""

    symbols: tuple[str, ...]
    has_mask_row: bool

    @classmethod
    def load(cls, path: str | Path, add_mask: bool = True, drop_last: int = 0) -> Dictionary:
        """Read dict.txt ("<symbol> <count>" per line). `drop_last` removes trailing lines (the
        zero-clap checkpoints were trained without the last two madeupwords)."""
        path = Path(path)
        symbols = []
        for number, line in enumerate(read_text(path, "dictionary").splitlines(), 1):
            parts = line.rstrip().split(" ")
            if parts[-1] == "#fairseq:overwrite":
                parts = parts[:-1]
            if len(parts) < 2 or not parts[-1].isdigit():
                raise TokenizerError(f"{path}:{number}: expected '<symbol> <count>', got {line!r}")
            symbols.append(" ".join(parts[:-1]))
        if drop_last:
            symbols = symbols[:-drop_last]
        return cls(SPECIALS + tuple(symbols) + ((MASK_SYMBOL,) if add_mask else ()), add_mask)

    def __len__(self) -> int:
        return len(self.symbols)

    @property
    def mask_id(self) -> int:
        """`<mask>`'s row, or len(dictionary) when there is none (zero-clap)."""
        return len(self) - 1 if self.has_mask_row else len(self)

    @property
    def sha256(self) -> str:
        """Identity of the id space that data can contain: every symbol up to the trailing
        madeupword / `<mask>` padding, which text never encodes to. The GPT-2 dictionary and its
        zero-clap variant therefore share shards (as the reference's runs shared binarized data);
        shards of any other dictionary are refused."""
        symbols = list(self.symbols)
        while symbols and (symbols[-1] == MASK_SYMBOL or symbols[-1].startswith("madeupword")):
            symbols.pop()
        return hashlib.sha256("\n".join(symbols).encode()).hexdigest()

    def ordinary_ids(self) -> np.ndarray:
        """Ids that random replacement may draw: not special, not madeupword, not `<mask>`."""
        return np.array([i for i, s in enumerate(self.symbols)
                         if i >= len(SPECIALS) and s != MASK_SYMBOL and not s.startswith("madeupword")
                         and not (s.startswith("[") and s.endswith("]"))],  # WordPiece's [unused0] ...
                        dtype=np.int64)
