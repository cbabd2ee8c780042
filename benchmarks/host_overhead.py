#!/usr/bin/env python
"""Host time of an eager step at negligible compute: megamlm vs Hugging Face, same configuration.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/host_overhead.py            # CPU
    PYTHONPATH=. python benchmarks/host_overhead.py --device cuda                 # GPU: launch-bound

A GPU runs an eager model no faster than the host queues its kernels. At small per-step work (GLUE
fine-tuning, small micro-batches, short sequences) the host's time per forward and backward — Python,
module calls, autograd nodes, kernel launches — is the step time. With a tiny width (h = 64) and
16 tokens the compute is negligible, so what this times is that host cost. Rows: megamlm with its
one-rank linears (plain matmuls, model/layer.py), megamlm with megatron-core's autograd.Function
linears (`TensorParallelLinear.one_rank_fast_path = False`), and transformers' RobertaForMaskedLM;
all post-LN RoBERTa with learned positions and the same dropout, interleaved rounds, medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from megamlm.config import ParallelConfig, load_config
from megamlm.convert.hf import hf_config_values
from megamlm.convert.hf_export import hf_format
from megamlm.model.layer import TensorParallelLinear
from megamlm.objectives import MaskedLM
from megamlm.parallel import init_distributed, seed_everything

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=16, help="sequence length (batch 1)")
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    overrides = [f"model.num_layers={args.layers}", "model.hidden_size=64", "model.num_attention_heads=4",
                 "model.ffn_hidden_size=128", "model.vocab_size=1100", f"model.max_positions={args.tokens}",
                 f"data.seq_length={args.tokens}", f"model.hidden_dropout={args.dropout}",
                 f"model.attention_dropout={args.dropout}"]
    files = [ROOT / "configs/model/tiny.yaml", ROOT / "configs/variants/baseline.yaml"]
    model_cfg = load_config(files, overrides).model
    ctx = init_distributed(ParallelConfig())
    device = torch.device(args.device)
    seed_everything(1, ctx)
    ours = MaskedLM(model_cfg, ctx, seed=1).to(device).train()
    fmt = hf_format(model_cfg)
    hf = fmt.build(hf_config_values(model_cfg, fmt, model_cfg.pad_token_id), attn_implementation="sdpa")
    hf = hf.to(device).train()
    tokens = torch.randint(4, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 0
    index = torch.arange(1, args.tokens, 6)  # every sixth position a target
    host_layout = (tokens, None, None)  # the batch's layout on the host, as the loop passes it (Batch.host_layout)
    tokens, index = tokens.to(device), index.to(device)
    targets = tokens.flatten()[index]
    labels = torch.full_like(tokens, -100)
    labels.view(-1)[index] = targets

    def megamlm_step(fast: bool):
        def step():
            TensorParallelLinear.one_rank_fast_path = fast
            ours(tokens, index, targets=targets, host_layout=host_layout).sum().backward()
        return step

    def hf_step():
        hf(input_ids=tokens, labels=labels).loss.backward()

    steps = {"megamlm": megamlm_step(True), "megamlm, megatron linears": megamlm_step(False), "hf": hf_step}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # warm-up
        for _ in range(3):
            step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / args.steps)
    TensorParallelLinear.one_rank_fast_path = True
    print(f"host time of one forward + backward: {args.layers} layers, h=64, {args.tokens} tokens, dropout "
          f"{args.dropout}, {args.rounds} interleaved rounds x {args.steps} steps, device {device}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'implementation':<28}{'ms / step':>10}{'min':>8}{'max':>8}{'us / layer':>12}{'x hf':>7}")
    hf_ms = statistics.median(times["hf"]) * 1e3
    for name, values in times.items():
        ms = statistics.median(values) * 1e3
        print(f"{name:<28}{ms:>10.2f}{min(values) * 1e3:>8.2f}{max(values) * 1e3:>8.2f}"
              f"{ms * 1e3 / args.layers:>12.0f}{ms / hf_ms:>7.2f}")


if __name__ == "__main__":
    main()
