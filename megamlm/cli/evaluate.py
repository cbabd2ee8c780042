"""`megamlm eval`: a model folder's MLM perplexity with fixed masking, and length extrapolation (several folders
at several lengths: a table and a plot)."""

from __future__ import annotations

import argparse
from pathlib import Path

from megamlm.cli.arguments import integer_list
from megamlm.errors import MegamlmError
from megamlm.files import RUN_FINAL, check_writable


def cmd_eval(args) -> int:
    from megamlm.evaluate import evaluate_lengths, extrapolation_report

    if args.what == "ppl":
        row = evaluate_lengths(args.checkpoint[0], args.data, [args.seq_length], args.max_tokens,
                               args.batch_size)[0]
        if "skipped" in row:
            raise MegamlmError(f"length {args.seq_length}: {row['skipped']}")
        print(f"{args.checkpoint[0]}: MLM loss {row['loss']:.4f} nats | perplexity {row['ppl']:.2f} | "
              f"{row['masked_tokens']:,} masked tokens in {row['samples']} samples of {args.seq_length}")
        return 0
    check_writable(args.out, "--out")  # before evaluating every model at every length
    results = {Path(c).parent.name if Path(c).name == RUN_FINAL else Path(c).name:
               evaluate_lengths(c, args.data, args.lengths, args.max_tokens, args.batch_size) for c in args.checkpoint}
    print(extrapolation_report(results, args.out, args.train_length), end="")
    print(f"plot: {Path(args.out) / 'ppl-vs-length.png'}")
    return 0


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=("ppl", "extrapolation"))
    parser.add_argument("--checkpoint", action="append", required=True,
                        help="model folder; extrapolation takes several (one curve each)")
    parser.add_argument("--data", required=True,
                        help="shard folder (its valid split) or a corpus file: text (each non-empty line a document) "
                             "or jsonl (each line's \"text\"), compressed or not")
    parser.add_argument("--seq-length", type=int, default=128, help="ppl: sample length")
    parser.add_argument("--lengths", type=integer_list, default=[128, 256, 512, 1024, 2048],
                        help="extrapolation: lengths (comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=65536, help="evaluation tokens (per length)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per batch at the shortest length")
    parser.add_argument("--train-length", type=int, default=None, help="marked in the plot")
    parser.add_argument("--out", default="extrapolation", help="extrapolation: output folder")
