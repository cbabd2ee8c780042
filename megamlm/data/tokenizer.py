"""Tokenizers (Hugging Face `tokenizers`) mapped to megamlm's (fairseq's) dictionary ids
(data/dictionary.py): GPT-2 byte-level BPE here (RoBERTa), WordPiece (BERT) and SentencePiece
(ALBERT) in data/pieces.py. `Tokenizer.load` picks one by name or by the files in a folder.

fairseq's RoBERTa never sees GPT-2 ids: GPT-2 id strings are looked up in `dict.txt`
(ordered by corpus frequency), so

    fairseq id = 4 + (line of str(gpt2_id) in dict.txt);  <s>=0 <pad>=1 </s>=2 <unk>=3
    <mask> = last id (50264 with the GPT-2 dict.txt: 4 + 50260 lines; 50265 symbols)

The zero-clap dictionary drops the last two madeupwords and has no `<mask>` row: 50262 symbols,
mask id = 50262 (the model embeds it as the zero vector).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from importlib import resources
from pathlib import Path

import numpy as np

from megamlm.data.dictionary import (BOS, EOS, MASK_SYMBOL, PAD, SPECIALS, UNK, Dictionary,  # noqa: F401
                                     TokenizerError)
from megamlm.data.documents import BuildStats, corpus_paths, text_lines, train_tokenizer_on
from megamlm.data.pieces import JsonTokenizer, PieceTokenizer, WordPieceTokenizer, refuse_existing
from megamlm.data.progress import progress_bar
from megamlm.files import staged_files

BYTES = 256
"""The byte-level BPE's first pieces: one per byte value."""

COUNT_BATCH_LINES = 10_000
"""Lines encoded at a time to count dict.txt's frequencies."""

GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "dict.txt": "2c31c5b236661067fe8626775eb995ef5fe808ac87d2ad4a6ddbef68550f5cc6",
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bundled_gpt2_dir() -> Path:
    return Path(str(resources.files("megamlm.data") / "assets" / "gpt2"))


class Tokenizer:
    """Text <-> fairseq ids through GPT-2 byte-level BPE. Encoding is lossless: decode(encode(t)) == t."""

    pair_separator = (EOS, EOS)
    """Between the two texts of a pair (GLUE): RoBERTa's `</s></s>`."""

    def __init__(self, encoder_json: str | Path, vocab_bpe: str | Path, dictionary: Dictionary):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        self.encoder_json, self.vocab_bpe = Path(encoder_json), Path(vocab_bpe)
        for path in (self.encoder_json, self.vocab_bpe):
            if not path.is_file():
                raise TokenizerError(f"tokenizer file not found: {path}")
        try:
            bpe = models.BPE.from_file(str(self.encoder_json), str(self.vocab_bpe))
        except Exception as err:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"cannot read BPE from {self.encoder_json}, {self.vocab_bpe}: {err}") from None
        self._bpe = HFTokenizer(bpe)
        self._bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._bpe.decoder = decoders.ByteLevel()
        self.dictionary = dictionary
        vocab = json.loads(self.encoder_json.read_text(encoding="utf-8"))
        index = {s: i for i, s in enumerate(dictionary.symbols)}
        # BPE id -> fairseq id (unknown to dict.txt -> <unk>), and back (-1: not a BPE token)
        self._to_fairseq = np.full(len(vocab), UNK, dtype=np.int64)
        self._to_bpe = np.full(len(dictionary), -1, dtype=np.int64)
        # fairseq id -> starts a word (whole-word / span masking): its byte-level piece begins with
        # the space marker Ġ; specials, madeupwords, <mask> (and zero-clap's mask id) are words alone
        self._word_starts = np.ones(len(dictionary) + 1, dtype=bool)
        for piece, bpe_id in vocab.items():
            fairseq_id = index.get(str(bpe_id))
            if fairseq_id is not None:
                self._to_fairseq[bpe_id] = fairseq_id
                self._to_bpe[fairseq_id] = bpe_id
                self._word_starts[fairseq_id] = piece.startswith("\u0120")
        # a vocabulary without a single Ġ piece has no word-start rule (every id would be a word)
        self._has_word_rule = any(piece.startswith("\u0120") for piece in vocab)
        self.sha256 = hashlib.sha256(
            self.encoder_json.read_bytes() + self.vocab_bpe.read_bytes()).hexdigest()

    def word_starts(self) -> np.ndarray | None:
        """[len(dictionary) + 1] bool: the fairseq id begins a word (whole-word and span masking);
        None when the vocabulary has no word-start rule (no piece begins with the space marker Ġ)."""
        return self._word_starts if self._has_word_rule else None

    @classmethod
    def gpt2(cls, zero_clap: bool = False) -> Tokenizer:
        """The bundled GPT-2 files (hashes verified). zero_clap: 50262 symbols, no <mask> row."""
        folder = bundled_gpt2_dir()
        for name, digest in GPT2_SHA256.items():
            if _sha256(folder / name) != digest:
                raise TokenizerError(f"{folder / name} is corrupt: sha256 differs from {digest}; "
                                     f"reinstall megamlm")
        dictionary = Dictionary.load(folder / "dict.txt", add_mask=not zero_clap,
                                     drop_last=2 if zero_clap else 0)
        return cls(folder / "encoder.json", folder / "vocab.bpe", dictionary)

    @classmethod
    def load(cls, spec: str, zero_clap: bool = False) -> Tokenizer | PieceTokenizer:
        """`gpt2`, `gpt2-zero-clap`, a folder with encoder.json, vocab.bpe and dict.txt, a WordPiece
        folder (vocab.txt: `megamlm shards train-wordpiece`, an imported BERT's) or a SentencePiece
        folder (tokenizer.json + pieces.json: an imported ALBERT's)."""
        if spec in ("gpt2", "gpt2-zero-clap"):
            return cls.gpt2(zero_clap=zero_clap or spec == "gpt2-zero-clap")
        for kind in (WordPieceTokenizer, JsonTokenizer):
            if (Path(spec) / kind.FILES[0]).is_file():
                return kind(spec)
        return cls.from_dir(spec, zero_clap=zero_clap)

    @classmethod
    def from_dir(cls, folder: str | Path, zero_clap: bool = False) -> Tokenizer:
        """encoder.json + vocab.bpe + dict.txt from a folder (e.g. written by `train`)."""
        folder = Path(folder)
        if not (folder / "dict.txt").is_file():
            raise TokenizerError(f"dictionary not found: {folder / 'dict.txt'}")
        dictionary = Dictionary.load(folder / "dict.txt", add_mask=not zero_clap)
        return cls(folder / "encoder.json", folder / "vocab.bpe", dictionary)

    @staticmethod
    def train(files: list[str | Path], out_dir: str | Path, vocab_size: int = 32000,
              min_frequency: int = 2) -> Path:
        """Train a byte-level BPE on corpus files (text or jsonl, compressed or not: documents.text_lines); write
        encoder.json, vocab.bpe and a dict.txt (BPE ids ordered by corpus frequency, as fairseq-preprocess
        would) to out_dir."""
        from tokenizers import ByteLevelBPETokenizer

        out, files = Path(out_dir), corpus_paths(files)
        if vocab_size <= BYTES:
            raise TokenizerError(f"--vocab-size {vocab_size}: a byte-level BPE holds the {BYTES} bytes first, then a "
                                 f"piece per merge; at least {BYTES + 1}")
        refuse_existing(out, ("encoder.json", "vocab.bpe", "dict.txt"))
        trainer = ByteLevelBPETokenizer(add_prefix_space=False)
        train_tokenizer_on(files, lambda lines: trainer.train_from_iterator(
            lines, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[], show_progress=False))
        counts = np.zeros(trainer.get_vocab_size(), dtype=np.int64)
        # one iterator: each iter() of a tqdm bar is a generator of its own (islice'd, lines were lost)
        lines = iter(progress_bar(text_lines(files, BuildStats()), desc="counting", unit=" lines"))
        # a second pass (the corpus is never held in memory), encoded in batches: tokenizers' threads
        while batch := [piece for line in itertools.islice(lines, COUNT_BATCH_LINES)
                        for piece in line.splitlines(keepends=True)]:
            ids = [np.asarray(e.ids, dtype=np.int64) for e in trainer.encode_batch(batch)]
            counts += np.bincount(np.concatenate(ids), minlength=len(counts))
        order = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
        with staged_files(out) as tmp:  # all three files or none (a full disk)
            vocab_path, merges_path = trainer.save_model(str(tmp))  # tokenizers' own names, renamed
            os.replace(vocab_path, tmp / "encoder.json")
            os.replace(merges_path, tmp / "vocab.bpe")
            (tmp / "dict.txt").write_text("".join(f"{i} {counts[i]}\n" for i in order))
        return out

    def encode(self, text: str) -> np.ndarray:
        """Text -> fairseq ids (no <s>/</s>)."""
        return self._to_fairseq[np.asarray(self._bpe.encode(text).ids, dtype=np.int64)]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self._to_fairseq[np.asarray(e.ids, dtype=np.int64)]
                for e in self._bpe.encode_batch(texts)]

    def decode(self, ids) -> str:
        """fairseq ids -> text; specials, madeupwords and the mask are skipped."""
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < len(self._to_bpe))]
        bpe_ids = self._to_bpe[ids]
        return self._bpe.decode(bpe_ids[bpe_ids >= 0].tolist())

    def bpe_ids(self, text: str) -> list[int]:
        """The raw BPE (GPT-2) ids, before the dictionary mapping."""
        return self._bpe.encode(text).ids
