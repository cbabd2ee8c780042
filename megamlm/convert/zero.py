"""ZeRO consolidation: a DeepSpeed training checkpoint of any DP × TP layout -> full fp32 tensors.

DeepSpeed's `zero_to_fp32` merges the data-parallel partitions of one model-parallel rank but cannot
merge tensor-parallel shards. We give it one TP rank at a time (a folder of links to that rank's
files), then concatenate the TP shards with the partition table of `megamlm.model.tp`.
The checkpoint is megamlm's own (`<run_dir>/checkpoints/stepN`), so its pickles are trusted.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import torch

from megamlm.config import Config, config_from_dict
from megamlm.model.tp import merge_shards
from megamlm.files import CHECKPOINT_LATEST, CHECKPOINT_META, RUN_CHECKPOINTS, verify_files


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder, a `checkpoints` folder (its `latest`), or a run folder (its checkpoints/latest)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such folder; pass <run_dir>, <run_dir>/checkpoints or "
                                f"<run_dir>/checkpoints/stepNNNNNNNN")
    if (path / RUN_CHECKPOINTS).is_dir():
        path = path / RUN_CHECKPOINTS
    if (path / CHECKPOINT_LATEST).is_file():
        path = path / (path / CHECKPOINT_LATEST).read_text().strip()
    if not (path / CHECKPOINT_META).is_file():
        raise FileNotFoundError(f"{path}: not a megamlm training checkpoint (no {CHECKPOINT_META}); pass "
                                f"<run_dir>, <run_dir>/checkpoints or <run_dir>/checkpoints/stepNNNNNNNN")
    if not (path / "complete").exists():
        raise FileNotFoundError(f"{path}: checkpoint is incomplete (the save was interrupted)")
    return path


def _tp_rank_state(folder: Path, tp_rank: int) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob(f"*mp_rank_{tp_rank:02d}_*.pt"))
    if not files:
        raise FileNotFoundError(f"{folder}: no DeepSpeed files for tensor-parallel rank {tp_rank}")
    # ZeRO partitions the optimizer (stages 1-3) into zero_pp_rank_* files; a stage-0 engine (also
    # every fp32 run on one data-parallel rank) keeps the whole model in mp_rank_*_model_states.pt
    if not any(folder.glob(f"zero_pp_rank_*_mp_rank_{tp_rank:02d}_optim_states.pt")):
        module = torch.load(folder / f"mp_rank_{tp_rank:02d}_model_states.pt", map_location="cpu",
                            weights_only=False)["module"]
        return {k: v.float() for k, v in module.items() if not k.endswith("_extra_state")}
    from deepspeed.utils.zero_to_fp32 import _get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor

    with tempfile.TemporaryDirectory() as tmp:
        for file in files:
            (Path(tmp) / file.name).symlink_to(file.resolve())
        with contextlib.redirect_stdout(io.StringIO()):
            state = _get_fp32_state_dict_from_zero_checkpoint(tmp, exclude_frozen_parameters=False)
            return to_torch_tensor(state)


def consolidate(path: str | Path) -> tuple[Config, dict[str, torch.Tensor], Path]:
    """(the run's config, full fp32 tensors by parameter name, the step folder used)."""
    folder = resolve_checkpoint(path)
    meta = json.loads((folder / CHECKPOINT_META).read_text())
    verify_files(folder, meta.get("files", {}), source=str(folder / CHECKPOINT_META))  # names a damaged file
    cfg = config_from_dict(meta["config"], origin=str(folder / CHECKPOINT_META))
    tp = cfg.parallel.tensor_parallel
    shards = [_tp_rank_state(folder, rank) for rank in range(tp)]
    full = merge_shards(shards, cfg.model)
    return cfg, full, folder
