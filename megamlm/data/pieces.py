"""WordPiece (BERT), SentencePiece (ALBERT) and byte-level BPE (ModernBERT) vocabularies mapped to megamlm's ids.

megamlm's data, masking and models use one id convention (data/dictionary.py), so a vocabulary with
its own specials is mapped into it: the specials move to fairseq's places and every other piece keeps
its order,

    BERT:       [CLS] -> 0 (<s>), [PAD] -> 1, [SEP] -> 2 (</s>), [UNK] -> 3, other pieces, [MASK] last
    ALBERT:     [CLS] -> 0,       <pad> -> 1, [SEP] -> 2,        <unk> -> 3, other pieces, [MASK] last
    ModernBERT: [CLS] -> 0,       [PAD] -> 1, [SEP] -> 2,        [UNK] -> 3, other pieces, [MASK] last
    XLM-R:      <s>   -> 0,       <pad> -> 1, </s>  -> 2,        <unk> -> 3, other pieces, <mask> last

as many ids as the vocabulary has pieces (bert-base-uncased: 30,522; albert-base-v2: 30,000;
xlm-roberta-base: 250,002, already in this order). `vocab_order` is that permutation (megamlm id -> the
vocabulary's id), which the Hugging Face converters apply to the embedding rows. BERT's, ALBERT's and
ModernBERT's pair texts as `[CLS] A [SEP] B [SEP]` (the model's token types count the separators:
model.token_types), RoBERTa-shaped models with a tokenizer.json (XLM-R) as `<s> A </s></s> B </s>`.

    WordPiece folder:  vocab.txt (one piece per line) + wordpiece.json {"lowercase": bool}
    tokenizer.json folder (SentencePiece, byte-level BPE): tokenizer.json (Hugging Face `tokenizers`) +
                       pieces.json (the special names, the word-start mark, transformers' tokenizer class)
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from megamlm.data.dictionary import EOS, MASK_SYMBOL, SPECIALS, Dictionary, TokenizerError
from megamlm.data.documents import BuildStats, corpus_paths, text_lines, train_tokenizer_on
from megamlm.data.progress import progress_bar
from megamlm.errors import check_ranges
from megamlm.files import check_writable, read_text, staged_files


class PieceTokenizer:
    """Text <-> megamlm ids for a vocabulary with its own specials; subclasses read the files and
    provide `_encode` (text -> vocabulary ids) and `_decode` (vocabulary ids -> text)."""

    FILES: tuple[str, ...] = ()
    """The folder's files; the first one identifies the kind (Tokenizer.load)."""
    pair_separator = (EOS,)
    """`[CLS] A [SEP] B [SEP]`: one separator between a pair's texts."""

    def __init__(self, folder: Path, pieces: list[str], specials: tuple[str, ...], mask: str,
                 word_start) -> None:
        """`pieces`: the vocabulary in its own id order; `specials`: its names for <s> <pad> </s> <unk>;
        `word_start(piece)`: whether a piece begins a word."""
        self.folder = folder
        self.mask_text = mask
        """The vocabulary's own name of the mask ([MASK]), which fill-mask also reads."""
        index = {piece: i for i, piece in enumerate(pieces)}
        missing = [s for s in (*specials, mask) if s not in index]
        if missing:
            raise TokenizerError(f"{folder / self.FILES[0]}: no {', '.join(missing)} piece: not a "
                                 f"{type(self).__name__.removesuffix('Tokenizer')} vocabulary with "
                                 f"{', '.join((*specials, mask))}")
        moved = {index[s] for s in (*specials, mask)}
        self.vocab_order = np.array([index[s] for s in specials]
                                    + [i for i in range(len(pieces)) if i not in moved] + [index[mask]])
        """[V] megamlm id -> the vocabulary's id."""
        self._to_ours = np.argsort(self.vocab_order)
        middle = tuple(pieces[i] for i in self.vocab_order[len(SPECIALS):-1])
        self.dictionary = Dictionary(SPECIALS + middle + (MASK_SYMBOL,), has_mask_row=True)
        self._word_starts = np.array([i < len(SPECIALS) or word_start(s)
                                      for i, s in enumerate(self.dictionary.symbols)] + [True])
        self.sha256 = hashlib.sha256(b"".join((folder / name).read_bytes() for name in self.FILES)).hexdigest()

    def word_starts(self) -> np.ndarray:
        """[len(dictionary) + 1] bool: the id begins a word (whole-word and span masking)."""
        return self._word_starts

    def encode(self, text: str) -> np.ndarray:
        """Text -> megamlm ids (no [CLS]/[SEP])."""
        return self._to_ours[np.asarray(self._encode([text])[0], dtype=np.int64)]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self._to_ours[np.asarray(ids, dtype=np.int64)] for ids in self._encode(texts)]

    def decode(self, ids) -> str:
        """megamlm ids -> text; specials and the mask are skipped."""
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= len(SPECIALS)) & (ids < len(self.dictionary) - 1)]
        return self._decode(self.vocab_order[ids].tolist())

    def _encode(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError


def refuse_existing(out: Path, names: tuple[str, ...]) -> None:
    """A trainer's check before any work: `out` holds none of the files it writes, and can be written."""
    existing = [name for name in names if (out / name).exists()]
    if existing:
        raise TokenizerError(f"{out} already holds {', '.join(existing)}; choose another --out "
                             f"(megamlm never overwrites files it did not write)")
    check_writable(out, "--out")


WORDPIECE_ALPHABET = 1000
"""Characters a trained WordPiece vocabulary holds at most (the most frequent; `tokenizers`' limit_alphabet
default for BERT): the others become [UNK]."""


def _wordpiece_alphabet(trainer, lines: Iterator[str]) -> tuple[list[str], list[str]]:
    """(the WORDPIECE_ALPHABET most frequent characters of the words `trainer` makes of `lines`, ties by the
    character; the "##c" pieces of those met inside a word), sorted: the pieces `tokenizers` would make, in an
    order that does not depend on its hash maps."""
    normalizer, pre_tokenizer = trainer.normalizer, trainer.pre_tokenizer
    every, first = Counter(), Counter()
    for line in progress_bar(lines, desc="alphabet", unit=" lines"):
        words = [word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line))]
        every.update("".join(words))
        first.update(word[0] for word in words)
    alphabet = sorted(every, key=lambda c: (-every[c], c))[:WORDPIECE_ALPHABET]
    inside = every - first  # met at least once after a word's first character
    return sorted(alphabet), sorted(f"##{c}" for c in set(alphabet) & inside.keys())


class WordPieceTokenizer(PieceTokenizer):
    """BERT's WordPiece: vocab.txt + wordpiece.json (the casing rule)."""

    VOCAB, SETTINGS = "vocab.txt", "wordpiece.json"
    FILES = (VOCAB, SETTINGS)
    SPECIALS = ("[CLS]", "[PAD]", "[SEP]", "[UNK]")
    MASK = "[MASK]"

    def __init__(self, folder: str | Path):
        from tokenizers import BertWordPieceTokenizer

        folder = Path(folder)
        pieces = read_text(folder / self.VOCAB, "WordPiece vocabulary").splitlines()
        settings = json.loads(read_text(folder / self.SETTINGS, "WordPiece settings"))
        self.lowercase = bool(settings.get("lowercase", True))
        super().__init__(folder, pieces, self.SPECIALS, self.MASK, lambda piece: not piece.startswith("##"))
        self._wordpiece = BertWordPieceTokenizer(str(folder / self.VOCAB), lowercase=self.lowercase)

    @classmethod
    def write(cls, folder: str | Path, pieces: list[str], lowercase: bool) -> Path:
        """A WordPiece folder from vocab.txt's lines (WordPiece id order) and the casing rule."""
        folder = Path(folder)
        with staged_files(folder) as tmp:  # both files or neither (a full disk)
            (tmp / cls.VOCAB).write_text("".join(f"{p}\n" for p in pieces), encoding="utf-8")
            (tmp / cls.SETTINGS).write_text(json.dumps({"lowercase": lowercase}) + "\n")
        return folder

    @classmethod
    def train(cls, files: list[str | Path], out_dir: str | Path, vocab_size: int = 30522,
              min_frequency: int = 2, lowercase: bool = True) -> Path:
        """Train a WordPiece vocabulary (BERT's specials first) on corpus files (text or jsonl, compressed or
        not: documents.text_lines) into out_dir."""
        from tokenizers import BertWordPieceTokenizer

        out, files = Path(out_dir), corpus_paths(files)
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", cls.MASK]
        check_ranges([(f"--vocab-size {vocab_size}", vocab_size, f">= {len(specials) + 1}")], TokenizerError)
        refuse_existing(out, cls.FILES)
        trainer = BertWordPieceTokenizer(lowercase=lowercase)

        def train(lines: Iterator[str]) -> None:
            alphabet, continuing = _wordpiece_alphabet(trainer, text_lines(files, BuildStats()))
            # the continuing pieces registered up front, in a fixed order: `tokenizers` (0.23) numbers them as
            # its hash map of words meets them, and breaks ties between merges by those numbers, so that two
            # trainings on one corpus gave other ids and a few other pieces (huggingface/tokenizers#1794)
            trainer.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=min_frequency,
                                        special_tokens=specials + continuing, initial_alphabet=alphabet,
                                        limit_alphabet=len(alphabet), show_progress=False)

        train_tokenizer_on(files, train)
        vocab = trainer.get_vocab()
        if len(vocab) > vocab_size:
            warnings.warn(f"the vocabulary holds {len(vocab)} pieces, more than --vocab-size {vocab_size}: BERT's "
                          f"{len(specials)} specials, the corpus's characters and their "
                          f"continuing (##) forms come first")
        return cls.write(out, sorted(vocab, key=vocab.get), lowercase)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._wordpiece.encode_batch(texts, add_special_tokens=False)]

    def _decode(self, ids: list[int]) -> str:
        return self._wordpiece.decode(ids)


class JsonTokenizer(PieceTokenizer):
    """A `tokenizers` tokenizer.json (ALBERT's SentencePiece Unigram, ModernBERT's byte-level BPE) +
    pieces.json naming its specials, the mark that begins a word and transformers' tokenizer class."""

    TOKENIZER, SPECIAL_NAMES = "tokenizer.json", "pieces.json"
    FILES = (TOKENIZER, SPECIAL_NAMES)
    WORD_MARKS = {"Metaspace": "\u2581", "ByteLevel": "\u0120"}
    """tokenizer.json's pre-tokenizer -> the mark a word-initial piece starts with (SentencePiece's ▁,
    byte-level BPE's Ġ)."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        path = folder / self.TOKENIZER
        read_text(path, "tokenizer.json")  # exists and is readable: named if not
        try:
            self._backend = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"{path}: not a tokenizers file ({err})") from None
        names = json.loads(read_text(folder / self.SPECIAL_NAMES, "special piece names"))
        self.tokenizer_class = names.get("tokenizer_class", "AlbertTokenizer")
        vocab = self._backend.get_vocab()
        pieces = sorted(vocab, key=vocab.get)
        if [vocab[p] for p in pieces] != list(range(len(pieces))):
            raise TokenizerError(f"{path}: ids are not 0..{len(pieces) - 1} without gaps")
        mark = names.get("word_mark", self.WORD_MARKS["Metaspace"])
        super().__init__(folder, pieces, tuple(names["specials"]), names["mask"], lambda piece: piece.startswith(mark))
        self.pair_separator = (EOS,) * int(names.get("pair_separators", 1))

    @classmethod
    def write(cls, folder: str | Path, tokenizer_json: str, specials: tuple[str, ...], mask: str,
              tokenizer_class: str = "AlbertTokenizer", pair_separators: int = 1) -> Path:
        """A tokenizer.json folder from a tokenizer.json's text, its names for <s> <pad> </s> <unk>, mask,
        transformers' class for it (written back on export) and the separators between a pair's texts
        (RoBERTa's 2: `</s></s>`)."""
        folder = Path(folder)
        pre = json.loads(tokenizer_json).get("pre_tokenizer") or {}  # one, or a Sequence of them
        kinds = [step.get("type") for step in [pre, *pre.get("pretokenizers", [])]]
        word_mark = next((cls.WORD_MARKS[k] for k in kinds if k in cls.WORD_MARKS), cls.WORD_MARKS["Metaspace"])
        names = {"specials": list(specials), "mask": mask, "word_mark": word_mark, "tokenizer_class": tokenizer_class}
        if pair_separators != 1:  # (the files of one-separator folders stay as they were)
            names["pair_separators"] = pair_separators
        with staged_files(folder) as tmp:  # both files or neither (a full disk)
            (tmp / cls.TOKENIZER).write_text(tokenizer_json, encoding="utf-8")
            (tmp / cls.SPECIAL_NAMES).write_text(json.dumps(names) + "\n")
        return folder

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids)
