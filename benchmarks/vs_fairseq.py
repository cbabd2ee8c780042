#!/usr/bin/env python
"""megamlm vs the EIFY/fairseq fork (the reference implementation): CPU training throughput, side by side.

    bash benchmarks/vs_fairseq.sh                      # builds the fork once, then runs this
    bash benchmarks/vs_fairseq.sh -- --lengths 128 --variants baseline --updates 60 --rounds 2   # a subset

Both train the main job's recipe (configs/demo.yaml: tiny = 4 layers, h 256, 4 heads, FFN 1024, the
GPT-2 vocabulary; AdamW (0.9, 0.98) eps 1e-6 wd 0.01, lr 5e-4 cosine with 100 warm-up updates;
fairseq `complete` samples) in one process, fp32, on the same documents token for token: megamlm's
shards of the bundled WikiText-103 valid+test text at the sample length (long documents split), whose
train split is written out as GPT-2 BPE ids, one document per line, and binarized by the fork's
`fairseq_cli.preprocess --srcdict` with the same dict.txt. The variants are the reference's: baseline
(learned positions, RoBERTa head, dropout 0.1 / 0.1) and zero-clap (ALiBi offset, CLAP head, the mask
as the zero vector, embeddings scaled by √h, dropout 0 / attention dropout 0.1). An update is 2,048
token slots: 16 samples of 128 or 4 of 512. Runs alternate (fork, megamlm, fork, ...) so drift hits
both; each run's throughput is the median of its logged windows of 10 updates after the first window
(non-pad tokens/s: fairseq's `wps`, megamlm's `tokens_per_s`). The table is printed and written to
<work>/vs_fairseq.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megamlm.config import load_config  # noqa: E402
from megamlm.data.shards import ensure_shards  # noqa: E402
from megamlm.data.stream import ShardSet  # noqa: E402
from megamlm.data.tokenizer import EOS, Tokenizer  # noqa: E402

SAMPLES_PER_UPDATE = {128: 16, 512: 4}
LOG_INTERVAL = 10
SYSTEMS = ("fork", "megamlm padded", "megamlm packed")  # one round runs each once, in this order
COMMON = {  # the fork's hydra config shared by both variants (megamlm's side is configs/demo.yaml)
    "common": {"log_format": "json", "log_interval": LOG_INTERVAL, "cpu": True, "seed": 1},
    "checkpoint": {"no_save": True},
    "criterion": "masked_lm",
    "optimizer": {"_name": "adam", "weight_decay": 0.01, "adam_betas": "(0.9,0.98)", "adam_eps": 1e-06},
    "lr_scheduler": {"_name": "cosine", "warmup_updates": 100, "min_lr": 0.0001},
    "model": {"encoder_layers": 4, "encoder_embed_dim": 256, "encoder_ffn_embed_dim": 1024,
              "encoder_attention_heads": 4},
}
VARIANTS = {  # name -> (megamlm config files after demo.yaml, the fork's model / task keys)
    "baseline": ([], {"model": {"_name": "roberta", "dropout": 0.1, "attention_dropout": 0.1}, "task": {}}),
    "zero-clap": (["configs/variants/zero-clap.yaml"], {  # the fork's zero_clap_pile.yaml
        "model": {"_name": "roberta", "dropout": 0.0, "attention_dropout": 0.1,
                  "no_token_positional_embeddings": True, "encoder_alibi": True,
                  "encoder_alibi_asymmetrical": True, "layernorm_embedding": False,
                  "contrastive_pretraining": True, "initial_beta": 1.0, "zero_masking": True,
                  "no_scale_embedding": False},
        "task": {"omit_mask": True}}),
}


def demo_config(length: int, variant: str = "baseline"):
    files = [ROOT / "configs/demo.yaml", *(ROOT / f for f in VARIANTS[variant][0])]
    return load_config(files, [f"data.seq_length={length}", f"data.shards=cache/wikitext-103-s{length}",
                               f"model.max_positions={max(512, length)}"])


def export_documents(length: int, work: Path, fork_python: str, fork_src: str) -> Path:
    """The train split of megamlm's shards at this length, binarized for the fork (once)."""
    out = work / f"data-{length}"
    if (out / "train.bin").is_file():
        return out
    cfg = demo_config(length)
    tokenizer = Tokenizer.gpt2()
    folder = ensure_shards(cfg.data, tokenizer)
    prefixes = []
    for split in ("train", "valid"):  # the fork loads a valid split even with validation disabled
        shards = ShardSet(folder, split)
        text = work / f"{split}-{length}.bpe"
        documents = 0
        with open(text, "w") as f:
            for shard in range(len(shards.shards)):
                starts = shards.doc_starts(shard)
                for start, end in zip(starts[:-1], starts[1:]):
                    ids = shards.read_tokens(shard, int(start), int(end))
                    # one document per line; the fork appends </s> to every line
                    f.write(" ".join(tokenizer.dictionary.symbols[i] for i in ids if i != EOS) + "\n")
                    documents += 1
        print(f"exported {documents:,} {split} documents of {folder} to {text}", flush=True)
        prefixes += [f"--{split}pref", str(text)]
    dictionary = ROOT / "megamlm/data/assets/gpt2/dict.txt"
    subprocess.run([fork_python, "-m", "fairseq_cli.preprocess", "--only-source", "--srcdict", str(dictionary),
                    *prefixes, "--destdir", str(out), "--workers", "2"],
                   check=True, env={**os.environ, "PYTHONPATH": fork_src}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    # zero-clap's dictionary: dict.txt without its last two madeupwords (50262 rows, the reference's)
    zero_clap = work / f"data-{length}-zero-clap"
    zero_clap.mkdir(exist_ok=True)
    lines = (out / "dict.txt").read_text().splitlines(keepends=True)
    (zero_clap / "dict.txt").write_text("".join(lines[:-2]))
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx"):
        if not (zero_clap / name).exists():
            (zero_clap / name).symlink_to(out / name)
    return out


def fork_config(variant: str, length: int, updates: int, work: Path) -> str:
    name = f"{variant}-{length}"
    own = VARIANTS[variant][1]
    config = {**COMMON,
              "task": {"_name": "masked_lm", "data": "???", "sample_break_mode": "complete",
                       "tokens_per_sample": length, **own["task"]},
              "dataset": {"batch_size": SAMPLES_PER_UPDATE[length], "num_workers": 0, "disable_validation": True},
              "optimization": {"clip_norm": 0, "lr": [0.0005], "max_update": updates, "update_freq": [1]},
              "model": {**own["model"], **COMMON["model"], "max_positions": max(512, length)}}
    (work / "configs").mkdir(parents=True, exist_ok=True)
    (work / "configs" / f"{name}.yaml").write_text("# @package _group_\n" + yaml.safe_dump(config, sort_keys=False))
    return name


def run_fork(variant: str, length: int, updates: int, work: Path, fork_python: str, fork_src: str) -> list[float]:
    name = fork_config(variant, length, updates, work)
    data = work / (f"data-{length}" + ("-zero-clap" if variant == "zero-clap" else ""))
    result = subprocess.run(
        [fork_python, "-m", "fairseq_cli.hydra_train", "--config-dir", str(work / "configs"), "--config-name", name,
         f"task.data={data}", f"hydra.run.dir={work / 'hydra' / name}"],
        env={**os.environ, "PYTHONPATH": fork_src}, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"the fork failed ({variant}, {length}):\n{result.stderr[-3000:]}")
    # "... | train_inner | {json}" or hydra's "[...][train_inner][INFO] - {json}"
    windows = [json.loads(line[line.index("{"):]) for line in (result.stdout + result.stderr).splitlines()
               if "train_inner" in line and "{" in line]
    return [float(w["wps"]) for w in windows]


def run_megamlm(variant: str, length: int, updates: int, work: Path, packing: str) -> list[float]:
    """packing: padded (the fork's layout: samples right-padded to the longest) or packed (megamlm's:
    whole samples end to end in a row of the same 2,048 token slots, nothing computed on padding)."""
    run_dir = work / "runs" / f"megamlm-{variant}-{length}-{packing}"
    configs = [a for f in ["configs/demo.yaml", *VARIANTS[variant][0]] for a in ("--config", f)]
    subprocess.run([sys.executable, "-m", "megamlm", "train", *configs, f"data.seq_length={length}",
                    f"data.shards=cache/wikitext-103-s{length}", f"model.max_positions={max(512, length)}",
                    f"train.micro_batch_size={SAMPLES_PER_UPDATE[length]}", f"train.steps={updates}",
                    f"train.log_interval={LOG_INTERVAL}", "train.eval_interval=1000000", "train.eval_batches=1",
                    "train.save_interval=1000000", f"train.run_dir={run_dir}", f"data.packing={packing}",
                    "--overwrite"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [e["tokens_per_s"] for e in events if e["event"] == "train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fork-python", required=True)
    parser.add_argument("--fork-src", required=True)
    parser.add_argument("--work", default=str(ROOT / ".fairseq"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512], choices=sorted(SAMPLES_PER_UPDATE))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--updates", type=int, default=60, help="updates per run (the first 10 are warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved (fork, megamlm) pairs per row")
    args = parser.parse_args()
    work = Path(args.work)
    rows = []
    for length in args.lengths:
        export_documents(length, work, args.fork_python, args.fork_src)
        for variant in args.variants:
            rates: dict[str, list[float]] = {system: [] for system in SYSTEMS}
            for round_ in range(args.rounds):
                for system in SYSTEMS:
                    start = time.perf_counter()
                    windows = (run_fork(variant, length, args.updates, work, args.fork_python, args.fork_src)
                               if system == "fork" else
                               run_megamlm(variant, length, args.updates, work, system.split()[-1]))
                    rates[system].append(statistics.median(windows[1:]))
                    print(f"{variant} {length} round {round_ + 1} {system}: {rates[system][-1]:,.0f} tokens/s "
                          f"({time.perf_counter() - start:.0f} s)", flush=True)
            rows.append((variant, length, rates))
    lines = [f"EIFY/fairseq 5d9ddfe7 vs megamlm, CPU fp32, {os.cpu_count()} cores, tiny, 2,048 token slots per "
             f"update, {args.updates} updates x {args.rounds} interleaved rounds, {time.strftime('%Y-%m-%d')}",
             "", "| variant | length | fork tokens/s | megamlm padded | / fork (per round) | megamlm packed | "
             "/ fork (per round) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for variant, length, rates in rows:
        fork = statistics.median(rates["fork"])
        cells = []
        for system in SYSTEMS[1:]:
            ratios = [m / f for f, m in zip(rates["fork"], rates[system])]
            cells += [f"{statistics.median(rates[system]):,.0f}",
                      f"**{statistics.median(rates[system]) / fork:.2f}x** ({', '.join(f'{r:.2f}' for r in ratios)})"]
        lines.append(f"| {variant} | {length} | {fork:,.0f} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (work / "vs_fairseq.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
