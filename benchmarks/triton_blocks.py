#!/usr/bin/env python
"""How much attention model.attention_backend=triton computes on real batches (no GPU needed): the
score slots (query x key pairs, in whole blocks) its forward kernel visits, beside sdpa's dense rows,
both against the ideal — each sample's length squared, what the MFU formula counts. sdpa computes
every padded row's [s, s], and in packed rows [L, L] per sample, L the batch's longest
(`sequences.PackedRows`).

    python benchmarks/triton_blocks.py [--batches 20] [--block-m 128] [--block-n 64]

Corpora as benchmarks/packing.py's at 2048: WikiText-103 valid+test (gpu.sh's loop rows: long documents
split, samples of paragraphs) and the Pile-like lengths in fairseq's `complete` samples. Layouts:
padded (micro-batch rows of seq_length) and packed (one row of micro-batch x seq_length). The count
follows `triton_blocks.span` (megamlm/model): each block of BLOCK_M queries visits the key blocks of BLOCK_N from its
groups' first position, aligned down, to their end (`group_spans`); padding queries visit none. "whole
blocks": the share of them in the kernels' whole blocks' loops (`triton_blocks.partition`: within the block's run of
equal groups, off the diagonal; no visibility test, ALiBi as a key and a query term), the rest masked.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from megamlm.config import load_config
from megamlm.data.shards import BuildOptions, build_shards
from megamlm.data.stream import MaskedBatches, ShardSet
from megamlm.data.tokenizer import Tokenizer
from megamlm.model.sequences import attention_groups
from megamlm.model.triton_attention import group_runs, group_spans
from megamlm.objectives import get_objective
from packing import ROOT, pile_like_corpus


def _per_block(values: torch.Tensor, block: int, pad: int, reduce: str) -> torch.Tensor:
    """[b, s] -> [b, blocks]: `reduce` over each block of positions, positions past s as `pad`."""
    b, s = values.shape
    blocks = -(-s // block)
    return getattr(F.pad(values, (0, blocks * block - s), value=pad).view(b, blocks, block), reduce)(-1)


def _ceil(x: torch.Tensor, block: int) -> torch.Tensor:
    return (x + block - 1).div(block, rounding_mode="floor") * block


def visited_blocks(groups: torch.Tensor, block_m: int, block_n: int) -> tuple[int, int]:
    """(key blocks the forward kernel visits, those of them it computes in its whole blocks' loops) for
    [b, s] groups, ALiBi on, no window: triton_blocks' `span` and `partition` in torch."""
    b, s = groups.shape
    spans, runs = group_spans(groups), group_runs(groups)
    # [b, blocks]: each query block's first key and one past its last (past s: no query), aligned down
    lo = _per_block(spans[0], block_m, s, "amin") // block_n * block_n
    hi = _per_block(spans[1], block_m, 0, "amax")
    visited = (hi - lo).clamp(min=0).add(block_n - 1).div(block_n, rounding_mode="floor")
    # the keys that every query of the block sees (their common run; positions past s do not narrow it)
    z = torch.maximum(lo, _per_block(runs[1], block_m, s, "amin") // block_n * block_n)
    a1 = torch.minimum(torch.maximum(_ceil(_per_block(runs[0], block_m, 0, "amax"), block_n), lo), z)
    first = torch.arange(0, s, block_m)  # the diagonal's key blocks [d1, d2)
    d1, d2 = _ceil((first + 2 - block_n).clamp(min=0), block_n), _ceil(first + block_m, block_n)
    a2 = torch.maximum(a1, torch.minimum(d1, z))
    b1 = torch.maximum(a2, torch.minimum(d2, z))
    return int(visited.sum()), int(((a2 - a1) + (z - b1)).div(block_n, rounding_mode="floor").sum())


def group_lengths(groups: torch.Tensor) -> torch.Tensor:
    """The length of every group (sample) of [b, s] groups, row by row."""
    return torch.cat([row[row >= 0].unique(return_counts=True)[1] for row in groups]).long()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20, help="micro-batches per corpus and layout")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--block-m", type=int, default=128)
    parser.add_argument("--block-n", type=int, default=64)
    args = parser.parse_args()
    tokenizer = Tokenizer.gpt2()
    with tempfile.TemporaryDirectory(prefix="megamlm-triton-blocks-") as work:  # the shards go with it, also on Ctrl-C
        compare(args, tokenizer, Path(work))


def compare(args: argparse.Namespace, tokenizer: Tokenizer, work: Path) -> None:
    length, block = 2048, args.block_m * args.block_n
    pile_like_corpus(work / "pile-like.txt", 3000)
    corpora = {"wikitext-103": ([ROOT / "data/wikitext-103/valid.txt", ROOT / "data/wikitext-103/test.txt"],
                                "split", "paragraphs"),
               "pile-like": ([work / "pile-like.txt"], "drop", "lines")}
    cfg = load_config([ROOT / "configs/model/tiny.yaml", ROOT / "configs/variants/baseline.yaml"],
                      [f"data.seq_length={length}", f"model.max_positions={length}"])
    corruption = get_objective(cfg).corruption(tokenizer, 1)
    print(f"score slots per micro-batch of {args.micro_batch} x {length}, {args.batches} micro-batches, "
          f"triton blocks {args.block_m} x {args.block_n}; / ideal = / Σ sample length²")
    print(f"{'corpus':<14}{'layout':<8}{'fill':>7}{'samples/row':>13}{'sdpa / ideal':>14}"
          f"{'triton / ideal':>16}{'triton / sdpa':>15}{'whole blocks':>14}")
    for name, (inputs, long_docs, text_mode) in corpora.items():
        shards = work / name
        build_shards(BuildOptions([str(p) for p in inputs], str(shards), seq_length=length, long_docs=long_docs,
                                  text_mode=text_mode, valid_fraction=0.0), tokenizer, progress=False)
        for packing in ("padded", "packed"):
            stream = MaskedBatches(ShardSet(shards), corruption, seq_length=length, micro_batch=args.micro_batch,
                                   block_mode="complete", shuffle_window=1000, pad_multiple=length, packing=packing)
            real = slots = dense = visited = whole = ideal = samples = rows = 0  # visited, whole: blocks
            for i, batch in enumerate(stream):
                if i == args.batches:
                    break
                groups = attention_groups(batch.documents < 0, None, batch.segments)
                lengths = group_lengths(groups)
                real, slots = real + batch.real_tokens(), slots + batch.inputs.numel()
                dense += groups.size(0) * length ** 2 if packing == "padded" else len(lengths) * int(lengths.max()) ** 2
                blocks, whole_blocks = visited_blocks(groups, args.block_m, args.block_n)
                visited, whole = visited + blocks, whole + whole_blocks
                ideal += int((lengths ** 2).sum())
                samples, rows = samples + len(lengths), rows + groups.size(0)
            print(f"{name:<14}{packing:<8}{100 * real / slots:>6.1f}%{samples / rows:>13.1f}{dense / ideal:>14.2f}"
                  f"{visited * block / ideal:>16.2f}{visited * block / dense:>15.2f}{100 * whole / visited:>13.1f}%")


if __name__ == "__main__":
    main()
