"""`megamlm shards`: build webdataset shards from text, inspect (and verify) a shard folder, or train a tokenizer
for them (BPE, WordPiece)."""

from __future__ import annotations

import argparse

from megamlm.data.shards import LONG_DOC_POLICIES, TEXT_MODES, BuildOptions, build_shards, summary_table


def cmd_shards(args) -> int:
    from megamlm.data.pieces import WordPieceTokenizer
    from megamlm.data.shard_report import describe, verify, verify_report  # the stream: torch, megatron-core
    from megamlm.data.tokenizer import Tokenizer

    if args.shards_verb == "inspect":
        print(describe(args.folder))
        if not args.verify:
            return 0
        report, intact = verify_report(verify(args.folder))
        print(report)
        return 0 if intact else 1
    if args.shards_verb == "train-bpe":
        out = Tokenizer.train(args.inputs, args.out, vocab_size=args.vocab_size)
        print(f"wrote {out}/encoder.json, vocab.bpe, dict.txt; build shards with --tokenizer {out}, train with "
              f"data.tokenizer={out} model.vocab_size={len(Tokenizer.load(str(out)).dictionary)}")
        return 0
    if args.shards_verb == "train-wordpiece":
        out = WordPieceTokenizer.train(args.inputs, args.out, vocab_size=args.vocab_size,
                                       lowercase=not args.cased)
        print(f"wrote {out}/vocab.txt, wordpiece.json; build shards with --tokenizer {out}, train with "
              f"data.tokenizer={out} model.vocab_size={len(Tokenizer.load(str(out)).dictionary)}")
        return 0
    tokenizer = Tokenizer.load(args.tokenizer)
    options = BuildOptions(inputs=args.inputs, out_dir=args.out, seq_length=args.seq_length,
                           long_docs=args.long_docs, text_mode=args.text_mode,
                           valid_fraction=args.valid_fraction, shard_tokens=args.shard_tokens,
                           workers=args.workers, seed=args.seed, strict=args.strict)
    print(summary_table(build_shards(options, tokenizer)))
    return 0


CORPUS_FILES = ("input files: jsonl (.jsonl, .json: each line's \"text\") or plain text, compressed with zstd, "
                "gzip, bzip2, xz or not, or Parquet (a text column; needs pyarrow); a quoted glob pattern "
                "('pile/*.jsonl.zst', ** for sub-folders) expands to its files, sorted")


def add_shards_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="shards_verb", required=True)
    build = sub.add_parser("build", help="tokenize corpus files (jsonl, text, Parquet) into webdataset shards")
    build.add_argument("inputs", nargs="+", help=CORPUS_FILES)
    build.add_argument("--out", required=True, help="output folder (must not hold shards yet)")
    # defaults: the data section's (BuildOptions takes them from DataConfig)
    build.add_argument("--seq-length", type=int, default=BuildOptions.seq_length,
                       help="sample length incl. <s>; longer documents follow --long-docs")
    build.add_argument("--long-docs", default=BuildOptions.long_docs, choices=LONG_DOC_POLICIES,
                       help="documents longer than a sample: drop (the reference), truncate, split")
    build.add_argument("--text-mode", default=BuildOptions.text_mode, choices=TEXT_MODES,
                       help="plain text: one document per blank-line-separated block, or per line")
    build.add_argument("--valid-fraction", type=float, default=BuildOptions.valid_fraction,
                       help="fraction of documents written to the valid split (default %(default)s)")
    build.add_argument("--shard-tokens", type=int, default=20_000_000, help="tokens per shard")
    build.add_argument("--workers", type=int, default=1,
                       help="tokenizer processes (each already uses all cores through tokenizers' "
                            "threads; more pay off only for many large input files)")
    build.add_argument("--seed", type=int, default=1, help="seed of the train/valid split")
    build.add_argument("--strict", action="store_true",
                       help="stop at the first malformed line instead of skipping and counting it")
    build.add_argument("--tokenizer", default="gpt2",
                       help="gpt2 | gpt2-zero-clap | folder with encoder.json, vocab.bpe, dict.txt "
                            "| WordPiece folder with vocab.txt")
    inspect = sub.add_parser("inspect", help="what a shard folder holds: its build, splits, samples per block mode")
    inspect.add_argument("folder", help="a folder `megamlm shards build` wrote")
    inspect.add_argument("--verify", action="store_true",
                         help="also read every document back as training does (index sha256, CRC-32, token ids); "
                              "exit 1 if any is damaged")
    bpe = sub.add_parser("train-bpe", help="train a byte-level BPE + dict.txt on corpus files")
    bpe.add_argument("inputs", nargs="+", help=CORPUS_FILES)
    bpe.add_argument("--out", required=True)
    bpe.add_argument("--vocab-size", type=int, default=32000)
    wordpiece = sub.add_parser("train-wordpiece", help="train a BERT WordPiece vocabulary on corpus files")
    wordpiece.add_argument("inputs", nargs="+", help=CORPUS_FILES)
    wordpiece.add_argument("--out", required=True)
    wordpiece.add_argument("--vocab-size", type=int, default=30522)
    wordpiece.add_argument("--cased", action="store_true", help="keep case (default: lowercase, as uncased BERT)")
