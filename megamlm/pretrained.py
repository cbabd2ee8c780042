"""A trained model as one folder: `model.pt` (full TP=1 tensors) + `config.yaml`.

Written at the end of training from any TP / ZeRO layout; loadable at any TP degree for
fill-mask, evaluation or further training.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from megamlm.config import Config, load_config
from megamlm.convert.reshard import full_state_dict, load_full_state_dict
from megamlm.parallel import ParallelContext


def export_pretrained(model: torch.nn.Module, cfg: Config, folder: str | Path,
                      zero_stage: int = 0) -> Path:
    """Collective: gather the full model (also from ZeRO-3 partitions); rank 0 writes it."""
    folder = Path(folder)
    gather = contextlib.nullcontext()
    if zero_stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gather:
        full = full_state_dict(model)
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.float().contiguous() for k, v in full.items()}, folder / "model.pt.tmp")
        (folder / "model.pt.tmp").replace(folder / "model.pt")
        (folder / "config.yaml").write_text(cfg.to_yaml())
    dist.barrier()
    return folder


def load_pretrained(folder: str | Path, ctx: ParallelContext, overrides: list[str] = ()):
    """(config, MaskedLM in eval mode) from an exported folder, at ctx's TP degree."""
    from megamlm.model import MaskedLM

    folder = Path(folder)
    if not (folder / "model.pt").is_file():
        raise FileNotFoundError(f"{folder / 'model.pt'} not found: not an exported megamlm model "
                                f"(training writes one to <run_dir>/final)")
    cfg = load_config([folder / "config.yaml"], [f"parallel.tensor_parallel={ctx.tp_size}", *overrides])
    model = MaskedLM(cfg.model, ctx, seed=cfg.train.seed)
    load_full_state_dict(model, torch.load(folder / "model.pt", map_location="cpu", weights_only=True))
    return cfg, model.eval()
