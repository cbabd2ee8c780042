"""`megamlm <verb>`: the command-line entry point. Every verb takes `--config FILE` (repeatable,
merged in order) and dotted overrides (`model.position=alibi`)."""

from __future__ import annotations

import argparse
import sys

import yaml

from megamlm.config import Config, ConfigError, load_config


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML experiment file (repeatable; later files win)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="dotted overrides applied after the files, e.g. model.position=alibi")


def cmd_config(cfg: Config, args) -> int:
    print(yaml.safe_dump(_plain(cfg.to_dict()), sort_keys=False), end="")
    return 0


def _plain(obj):
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return list(obj)
    return obj


def cmd_params(cfg: Config, args) -> int:
    from megamlm.model import MaskedLM
    from megamlm.parallel import destroy_distributed, init_distributed

    ctx = init_distributed(cfg.parallel)
    model = MaskedLM(cfg.model, ctx, seed=cfg.train.seed)
    m = cfg.model
    embedding = m.vocab_size * m.hidden_size
    if ctx.tp_rank == 0 and ctx.dp_rank == 0:
        total = model.parameter_count()
        print(f"{'layers x hidden x heads x ffn':<32}{m.num_layers} x {m.hidden_size} x "
              f"{m.num_attention_heads} x {m.ffn_hidden_size}")
        print(f"{'token embedding (tied)':<32}{embedding:>14,}")
        print(f"{'everything else':<32}{total - embedding:>14,}")
        print(f"{'total':<32}{total:>14,}  ({total / 1e6:.1f}M)")
        print(f"{'padded vocabulary at TP=' + str(ctx.tp_size):<32}{model.padded_vocab_size:>14,}")
    destroy_distributed()
    return 0


def cmd_smoke(cfg: Config, args) -> int:
    from megamlm.parallel import destroy_distributed, init_distributed
    from megamlm.smoke import run_smoke

    ctx = init_distributed(cfg.parallel)
    is_logger = ctx.tp_rank == 0 and ctx.dp_rank == 0
    result = run_smoke(cfg, ctx, log=print if is_logger else (lambda *_: None))
    destroy_distributed()
    if result["last"] >= result["first"]:
        print("smoke: the loss did not decrease", file=sys.stderr)
        return 1
    return 0


def cmd_shards(args) -> int:
    from megamlm.data.shards import BuildOptions, ShardError, build_shards, summary_table
    from megamlm.data.tokenizer import Tokenizer, TokenizerError

    try:
        if args.shards_verb == "train-bpe":
            out = Tokenizer.train(args.inputs, args.out, vocab_size=args.vocab_size)
            print(f"wrote {out}/encoder.json, vocab.bpe, dict.txt; build shards with --tokenizer {out}")
            return 0
        tokenizer = load_tokenizer(args.tokenizer)
        options = BuildOptions(inputs=args.inputs, out_dir=args.out, seq_length=args.seq_length,
                               long_docs=args.long_docs, text_mode=args.text_mode,
                               valid_fraction=args.valid_fraction, shard_tokens=args.shard_tokens,
                               workers=args.workers, seed=args.seed, strict=args.strict)
        manifest = build_shards(options, tokenizer)
    except (ShardError, TokenizerError) as err:
        print(f"megamlm: error: {err}", file=sys.stderr)
        return 2
    print(summary_table(manifest))
    return 0


def load_tokenizer(spec: str):
    """`gpt2`, `gpt2-zero-clap` (50262 symbols, no <mask> row) or a folder with BPE + dict.txt."""
    from megamlm.data.tokenizer import Tokenizer

    if spec in ("gpt2", "gpt2-zero-clap"):
        return Tokenizer.gpt2(zero_clap=spec == "gpt2-zero-clap")
    return Tokenizer.from_dir(spec)


def _add_shards_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="shards_verb", required=True)
    build = sub.add_parser("build", help="tokenize jsonl / jsonl.zst / text into webdataset shards")
    build.add_argument("inputs", nargs="+", help="input files (.jsonl, .jsonl.zst, .txt)")
    build.add_argument("--out", required=True, help="output folder (must not hold shards yet)")
    build.add_argument("--seq-length", type=int, default=512,
                       help="sample length incl. <s>; longer documents follow --long-docs")
    build.add_argument("--long-docs", default="drop", choices=["drop", "truncate", "split"],
                       help="documents longer than a sample: drop (the reference), truncate, split")
    build.add_argument("--text-mode", default="paragraphs", choices=["paragraphs", "lines"],
                       help="plain text: one document per blank-line-separated block, or per line")
    build.add_argument("--valid-fraction", type=float, default=0.0,
                       help="fraction of documents written to the valid split")
    build.add_argument("--shard-tokens", type=int, default=20_000_000, help="tokens per shard")
    build.add_argument("--workers", type=int, default=1,
                       help="tokenizer processes (each already uses all cores through tokenizers' "
                            "threads; more pay off only for many large input files)")
    build.add_argument("--seed", type=int, default=1, help="seed of the train/valid split")
    build.add_argument("--strict", action="store_true",
                       help="stop at the first malformed line instead of skipping and counting it")
    build.add_argument("--tokenizer", default="gpt2",
                       help="gpt2 | gpt2-zero-clap | folder with encoder.json, vocab.bpe, dict.txt")
    bpe = sub.add_parser("train-bpe", help="train a byte-level BPE + dict.txt on text files")
    bpe.add_argument("inputs", nargs="+")
    bpe.add_argument("--out", required=True)
    bpe.add_argument("--vocab-size", type=int, default=32000)


VERBS = {
    "config": (cmd_config, "print the resolved configuration"),
    "params": (cmd_params, "build the model and print its parameter counts"),
    "smoke": (cmd_smoke, "forward/backward/optimizer smoke run of the configured model"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megamlm", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    for name, (_, help_text) in VERBS.items():
        _add_config_args(sub.add_parser(name, help=help_text, description=help_text))
    _add_shards_args(sub.add_parser("shards", help="build and inspect token shards"))
    args = parser.parse_args(argv)
    if args.verb == "shards":
        return cmd_shards(args)
    try:
        cfg = load_config(args.config, args.overrides)
        return VERBS[args.verb][0](cfg, args)
    except ConfigError as err:
        print(f"megamlm: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
