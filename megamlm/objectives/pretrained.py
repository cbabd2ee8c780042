"""A model folder (model/folder.py) as a ready model: its objective's module, at any TP degree."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from megamlm.config import Config, ModelConfig, ParallelConfig, field_default, replace_config
from megamlm.model.attention import BACKEND_SETTINGS
from megamlm.model.encoder import Encoder
from megamlm.model.folder import ModelFolder, read_model_folder
from megamlm.model.reshard import load_full_state_dict
from megamlm.objectives.base import get_objective
from megamlm.parallel import ParallelContext, init_distributed


def _config(saved, folder, ctx: ParallelContext, overrides: list[str]) -> Config:
    """The folder's config at ctx's TP degree with `overrides`. An attention backend the folder's
    training chose that cannot run here (flex, varlen, triton, alibi-flash with dropout on a CPU) gives way to
    sdpa, with a warning: every backend computes the same attention. One the overrides name is kept."""
    origin = str(Path(folder) / "config.yaml")
    cfg = replace_config(saved.cfg, [f"parallel.tensor_parallel={ctx.tp_size}", *overrides], origin=origin)
    problem = Encoder.unsupported_here(cfg.model)
    if problem is not None and not any(o.startswith("model.attention_backend=") for o in overrides):
        warnings.warn(f"{folder}: {problem}. This run uses model.attention_backend=sdpa instead (the same attention)")
        # and the settings of the backend it leaves at their defaults: sdpa reads none of them (no second warning
        # that it ignores them); JSON is YAML, as overrides are read
        defaults = [f"model.{key}={json.dumps(field_default(ModelConfig, key))}" for key in BACKEND_SETTINGS]
        cfg = replace_config(cfg, ["model.attention_backend=sdpa", *defaults], origin=origin)
    return cfg


def load_pretrained(folder: str | Path, ctx: ParallelContext | None = None,
                    overrides: list[str] = ()) -> tuple[Config, nn.Module]:
    """(config, the objective's model in eval mode) from a model folder, at ctx's TP degree. Without
    `ctx`, a world of one process is set up (or the running one joined, TP=1)."""
    ctx = ctx or init_distributed(ParallelConfig())
    saved = read_model_folder(folder)
    cfg = _config(saved, folder, ctx, overrides)
    model = get_objective(cfg).build_pretrained(ctx, set(saved.full))
    load_full_state_dict(model, saved.full)
    return cfg, model.eval()


def load_encoder(folder: str | Path, ctx: ParallelContext | None = None,
                 overrides: list[str] = ()) -> tuple[Config, Encoder]:
    """(config, the bare Encoder in eval mode) from a model folder, the objective's heads left out
    (what fine-tuning starts from)."""
    return encoder_from(read_model_folder(folder), folder, ctx, overrides)


def encoder_from(saved: ModelFolder, folder: str | Path, ctx: ParallelContext | None = None,
                 overrides: list[str] = ()) -> tuple[Config, Encoder]:
    """load_encoder of a folder read already (`saved`, read from `folder`): one read for several models."""
    ctx = ctx or init_distributed(ParallelConfig())
    cfg = _config(saved, folder, ctx, overrides)
    return cfg, encoder_of(cfg.model, saved.full, ctx, seed=cfg.train.seed)


def encoder_of(model: ModelConfig, full: dict[str, torch.Tensor], ctx: ParallelContext, seed: int = 1) -> Encoder:
    """The bare Encoder of `model` holding the encoder's tensors of `full` (a model's full TP=1 tensors;
    the objective's heads left out), in eval mode."""
    encoder = Encoder(model, ctx, seed=seed)
    names = dict(encoder.named_parameters())
    load_full_state_dict(encoder, {k: v for k, v in full.items() if k in names})
    return encoder.eval()


def from_pretrained(folder: str | Path, ctx: ParallelContext | None = None, overrides: list[str] = ()) -> nn.Module:
    """A model folder (training's <run_dir>/final, or `megamlm convert` output) as a model in eval
    mode (MLM: a MaskedLM): `megamlm.from_pretrained("runs/demo/final")(token_ids)`."""
    return load_pretrained(folder, ctx, overrides)[1]
