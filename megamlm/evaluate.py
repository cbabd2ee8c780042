"""MLM perplexity with a fixed masking seed, at the training length or beyond it.

The evaluation text (a shard folder's valid split, or a corpus file: text or jsonl) becomes one token stream that
is cut into samples of `<s>` + L-1 tokens; every sample is masked by the fairseq rule with a fixed
seed, so every model and every variant is scored on exactly the same targets. Extrapolation cuts
the same stream at several lengths (the same number of tokens per length) — the experiment the
reference left open: learned position tables end at max_positions, ALiBi and sinusoidal do not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from megamlm.config import ParallelConfig
from megamlm.data.batch import collate
from megamlm.data.compression import codec_of
from megamlm.data.documents import BuildStats, check_input, holds_documents, read_documents
from megamlm.data.masking import Masker
from megamlm.data.stream import ShardSet
from megamlm.data.tokenizer import BOS, EOS, PAD, Tokenizer
from megamlm.errors import MegamlmError, check_ranges
from megamlm.files import read_text
from megamlm.objectives import LossTotals, Objective, get_objective, load_pretrained
from megamlm.parallel import init_distributed


def token_stream(data: str | Path, tokenizer: Tokenizer, max_tokens: int) -> np.ndarray:
    """Up to `max_tokens` ids: a shard folder's valid split (documents end with </s>) or a corpus file
    (`evaluation_texts`, each document ending with </s>)."""

    data = Path(data)
    pieces, total = [], 0
    if (data / "manifest.json").is_file():
        shards = ShardSet(data, "valid", tokenizer.dictionary.sha256)
        for i in range(len(shards.shards)):
            starts = shards.doc_starts(i)
            pieces.append(shards.read_tokens(i, int(starts[0]), int(starts[-1])))
            total += len(pieces[-1])
            if total >= max_tokens:
                break
    elif data.is_file():
        for text in evaluation_texts(data):
            pieces.append(np.append(tokenizer.encode(text), EOS))
            total += len(pieces[-1])
            if total >= max_tokens:
                break
    else:
        raise MegamlmError(f"--data {data}: neither a shard folder (manifest.json) nor a corpus file")
    if not pieces:
        raise MegamlmError(f"{data}: no evaluation text (a shard folder needs a valid split)")
    return np.concatenate(pieces)[:max_tokens]


def evaluation_texts(path: Path) -> Iterator[str]:
    """A corpus file's documents, stripped: a text file's non-empty lines, a jsonl or Parquet file's "text"
    (data/documents.py: compressed or not; its lines that are no document skipped). A jsonl file's lines read as
    text were scored as the model's perplexity on JSON."""
    if holds_documents(path) or codec_of(path) is not None:
        check_input(path)
        lines = (doc.text for doc in read_documents(path, "lines", BuildStats(), strict=False))
    else:
        lines = read_text(path, "evaluation text").splitlines()
    return (line.strip() for line in lines if line.strip())


def samples(stream: np.ndarray, length: int) -> np.ndarray:
    """[n, length]: <s> + consecutive length-1 tokens; the incomplete tail is dropped."""
    body = length - 1
    n = len(stream) // body
    if n == 0:
        raise MegamlmError(f"{len(stream)} evaluation tokens do not fill one sample of length {length}")
    # [n * body] -> [n, body], then prepend <s>
    blocks = stream[: n * body].reshape(n, body)
    return np.concatenate([np.full((n, 1), BOS, dtype=blocks.dtype), blocks], axis=1)


@torch.no_grad()
def mlm_perplexity(objective: Objective, model, tokens: np.ndarray, tokenizer: Tokenizer, batch_size: int = 8,
                   seed: int = 1) -> dict:
    """The objective's loss (nats per masked token) and metric over samples [n, L], masked by the
    fairseq rule at its default rates (not the model's training rates: every model gets the same
    targets)."""
    dictionary = tokenizer.dictionary
    masker = Masker(dictionary.mask_id, dictionary.ordinary_ids(), seed=seed)
    device = next(model.parameters()).device
    totals = LossTotals(objective)
    for start in range(0, len(tokens), batch_size):
        rows = [(row, start + i) for i, row in enumerate(tokens[start:start + batch_size])]
        totals.add(objective.loss(model, collate(rows, masker, 0, tokens.shape[1], PAD).to(device)))
    result = totals.reduce()
    return {**result, "masked_tokens": result.pop("units"), "samples": len(tokens)}


def evaluate_lengths(checkpoint: str | Path, data: str | Path, lengths: list[int], max_tokens: int,
                     batch_size: int = 8, ctx=None) -> list[dict]:
    """One row per length: {"length", "ppl", ...} or {"length", "skipped": reason}."""
    # a sample is <s> and at least one token
    check_ranges([(f"--max-tokens {max_tokens}", max_tokens, ">= 1"),
                  (f"--batch-size {batch_size}", batch_size, ">= 1"),
                  *((f"length {length}", length, ">= 2") for length in lengths)])
    cfg, model = load_pretrained(checkpoint, ctx or init_distributed(ParallelConfig()))
    tokenizer = Tokenizer.load(cfg.data.tokenizer, zero_clap=cfg.model.zero_mask)
    stream = token_stream(data, tokenizer, max_tokens)
    objective = get_objective(cfg)
    rows = []
    for length in lengths:
        if cfg.model.position == "learned" and length > cfg.model.max_positions:
            rows.append({"length": length, "skipped": f"learned position table holds {cfg.model.max_positions}"})
            continue
        rows.append({"length": length, **mlm_perplexity(objective, model, samples(stream, length), tokenizer,
                                                        max(1, batch_size * min(lengths) // length))})
    return rows


def extrapolation_report(results: dict[str, list[dict]], out: str | Path, train_length: int | None) -> str:
    """results.json, a markdown table and ppl-vs-length.png (log scale) into `out`; returns the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lengths = sorted({r["length"] for rows in results.values() for r in rows})
    lines = ["| model | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in results.items():
        by_length = {r["length"]: r for r in rows}
        cells = [f"{by_length[n]['ppl']:.1f}" if "ppl" in by_length.get(n, {}) else
                 f"n/a ({by_length[n]['skipped']})" if n in by_length else "–" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        points = [(r["length"], r["ppl"]) for r in rows if "ppl" in r]
        ax.plot(*zip(*points), marker="o", label=name)
    if train_length:
        ax.axvline(train_length, color="grey", linestyle="--", label=f"training length {train_length}")
    ax.set(xscale="log", yscale="log", xlabel="evaluation length (tokens)", ylabel="MLM perplexity",
           title="Length extrapolation")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # only the evaluated lengths
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ppl-vs-length.png", dpi=120)
    table = "\n".join(lines) + "\n"
    (out / "results.md").write_text(table)
    return table
