"""Forward/backward smoke run: the tiny model fits the unigram statistics of a synthetic corpus.

Stands in for the main job until the data pipeline and training issues land. Tokens follow a Zipf
law over the vocabulary, so a working model + optimizer must bring the masked-token loss from
ln(vocab) down towards the corpus entropy; a broken gradient path leaves it flat.
"""

from __future__ import annotations

import math
import time

import torch

from megamlm.config import Config
from megamlm.model import MaskedLM
from megamlm.parallel import ParallelContext, seed_everything

MASK_ID = 50264  # fairseq <mask> in the GPT-2 dictionary (zero-clap: vocab_size)


def zipf_batch(cfg: Config, generator: torch.Generator):
    """Token ids [b, s] (<s> first, random lengths, right-padded), masked positions, targets."""
    model, b, s = cfg.model, cfg.train.micro_batch_size, cfg.data.seq_length
    ranks = torch.arange(1, model.vocab_size - 3, dtype=torch.float)
    weights = 1.0 / ranks
    tokens = 4 + torch.multinomial(weights, b * s, replacement=True, generator=generator).view(b, s)
    tokens[:, 0] = 0
    lengths = torch.randint(s // 2, s + 1, (b,), generator=generator)
    padding = torch.arange(s)[None, :] >= lengths[:, None]
    tokens = tokens.masked_fill(padding, model.pad_token_id)
    masked = (torch.rand(b, s, generator=generator) < cfg.data.mask_prob) & ~padding
    masked[:, 1] = True
    targets = tokens[masked]
    mask_id = model.vocab_size if model.zero_mask else min(MASK_ID, model.vocab_size - 1)
    return tokens.masked_fill(masked, mask_id), masked, targets


def run_smoke(cfg: Config, ctx: ParallelContext, log=print) -> dict:
    seed_everything(cfg.train.seed, ctx)
    model = MaskedLM(cfg.model, ctx, seed=cfg.train.seed)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                              eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    # every data-parallel rank draws its own batches; TP peers draw the same ones
    generator = torch.Generator().manual_seed(cfg.train.seed * 1000 + ctx.dp_rank)
    log(f"model: {model.parameter_count() / 1e6:.2f}M parameters, TP={ctx.tp_size} DP={ctx.dp_size},"
        f" {cfg.train.steps} steps of {cfg.train.micro_batch_size}x{cfg.data.seq_length} tokens"
        f" per rank; initial loss should be near ln(vocab) = {math.log(cfg.model.vocab_size):.2f}")
    log(f"{'step':>5} {'loss':>8} {'ppl':>10} {'tokens/s':>10}")
    losses, start = [], time.perf_counter()
    for step in range(1, cfg.train.steps + 1):
        tokens, masked, targets = zipf_batch(cfg, generator)
        tokens, masked, targets = (t.to(ctx.device) for t in (tokens, masked, targets))
        t0 = time.perf_counter()
        loss = model.loss(model(tokens, masked), targets)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if ctx.dp_size > 1:
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad, group=ctx.dp_group)
                p.grad /= ctx.dp_size
        optim.step()
        losses.append(loss.item())
        rate = tokens.numel() * ctx.dp_size / (time.perf_counter() - t0)
        if step == 1 or step % max(1, cfg.train.steps // 10) == 0 or step == cfg.train.steps:
            log(f"{step:>5} {losses[-1]:>8.3f} {math.exp(losses[-1]):>10.1f} {rate:>10.0f}")
    elapsed = time.perf_counter() - start
    first, last = sum(losses[:3]) / len(losses[:3]), sum(losses[-3:]) / len(losses[-3:])
    log(f"done: loss {first:.3f} -> {last:.3f} (ppl {math.exp(first):.0f} -> {math.exp(last):.0f}) "
        f"in {elapsed:.1f}s")
    return {"losses": losses, "first": first, "last": last}
