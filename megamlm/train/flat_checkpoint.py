"""The flat engine's checkpoint file (train/flat.py).

Checkpoints use DeepSpeed's stage-0 file layout (`mp_rank_XX_model_states.pt`: the fp32 master
weights as the module, torch's AdamW state per parameter in model order, the schedule and counters),
written by DP rank 0 of each TP rank after a gather. Every reader therefore takes it as it takes a
stage-0 run: resume at any layout or engine (`train.elastic`), `megamlm convert`, DeepSpeed's
zero_to_fp32. The engine itself always loads through `train.elastic.load_full_state` (which fills
this rank's parts with `FlatEngine.set_full`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megamlm.parallel import ParallelContext


def write_stage0(engine, folder: Path) -> None:
    """Collective over DP: the flat engine `engine`'s state, written by DP rank 0 into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    optimizer, ctx = engine.optimizer, engine.ctx
    # empty before the first update: zero moments, step 0
    states = [{"step": torch.zeros(()), **{k: torch.zeros_like(m) for k in ("exp_avg", "exp_avg_sq")},
               **optimizer.state[m]} for m in engine.masters]
    fulls = {kind: gather_parts(ctx, [state[kind] for state in states] if kind != "fp32" else engine.masters)
             for kind in ("fp32", "exp_avg", "exp_avg_sq")}
    state = states[0]
    skipped = engine.skipped_steps
    if ctx.dp_rank != 0:
        return
    params = list(engine.module.named_parameters())
    # every entry of a parameter (a tied one may have several) holds its fp32 master weights
    owner = {p.data_ptr(): p for _, p in params}
    module = {key: engine.param_view(fulls["fp32"], owner[t.data_ptr()])
              if isinstance(t, torch.Tensor) and t.data_ptr() in owner else t
              for key, t in engine.module.state_dict().items()}
    moments = {i: {"step": state["step"].cpu().clone(), "exp_avg": engine.param_view(fulls["exp_avg"], p),
                   "exp_avg_sq": engine.param_view(fulls["exp_avg_sq"], p)} for i, (_, p) in enumerate(params)}
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    torch.save({"module": module, "engine": "flat",
                "optimizer": {"state": moments, "param_groups": [group | {"params": list(range(len(params)))}]},
                "lr_scheduler": engine.schedule.state_dict(), "global_steps": engine.global_steps,
                "global_samples": engine.global_samples, "skipped_steps": skipped,
                **({} if engine.scaler is None else {"loss_scaler": engine.scaler.state_dict()})},
               folder / f"mp_rank_{ctx.tp_rank:02d}_model_states.pt")


def gather_parts(ctx: ParallelContext, parts: list[torch.Tensor]) -> torch.Tensor | None:
    """A flat fp32 tensor whole on DP rank 0 (CPU) from every DP rank's parts of it (one per bucket);
    None elsewhere."""
    parts = [part.detach().float() for part in parts]
    if ctx.dp_size == 1:
        return torch.cat(parts).cpu()
    whole = []  # bucket by bucket, each rank's part of it in rank order
    for part in parts:
        ranks = [torch.empty_like(part) for _ in range(ctx.dp_size)] if ctx.dp_rank == 0 else None
        dist.gather(part, ranks, dst=dist.get_global_rank(ctx.dp_group, 0), group=ctx.dp_group)
        whole += ranks or []
    return torch.cat(whole).cpu() if ctx.dp_rank == 0 else None
