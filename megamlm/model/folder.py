"""A model as one folder, written by training and by `megamlm convert`, loadable at any TP degree.

    config.yaml                      the full megamlm config (model section describes the weights)
    model.pt                         full (TP=1) fp32 tensors by megamlm parameter name, or
    model-tp00-of-04.pt ...          one file per tensor-parallel rank (megatron layout, vocab padded)
    classification_heads.pt          optional: fairseq classification heads ({name}.dense.weight, ...)
    fairseq_source.pt                optional: what a fairseq source held besides weights (cfg, dtype,
                                     key style), so that the way back is exact

    megamlm-files.json               every file above with its size and sha256 (verified on load)

Folders are written to a temporary sibling and renamed into place: a failed write leaves nothing.
An existing folder is replaced only when it is megamlm's and the caller allows it (files.py).
Building a model from a folder is the objective's (objectives/pretrained.py: from_pretrained).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from megamlm.config import Config, load_config, replace_config
from megamlm.errors import CorruptFileError
from megamlm.files import CHECKPOINT_LATEST, CHECKPOINT_META, RUN_CHECKPOINTS, RUN_FINAL, staged_output, verify_record
from megamlm.model import names
from megamlm.model.reshard import full_state_dict
from megamlm.model.tp import merge_shards, split_full
from megamlm.parallel import barrier

MODEL_FILE = "model.pt"
SHARD_FILE = "model-tp{rank:02d}-of-{tp:02d}.pt"
HEADS_FILE = "classification_heads.pt"
SOURCE_FILE = "fairseq_source.pt"


@contextlib.contextmanager
def staged_write(folder: str | Path, cfg: Config, full: dict[str, torch.Tensor], tp: int = 1,
                 heads: dict[str, torch.Tensor] | None = None, source=None, overwrite: bool = False):
    """Write a model folder into a staging folder and yield it (for checks and extra files); it
    takes `folder`'s place when the block ends without an error (an existing model folder only with
    `overwrite`). Tensors: model.pt, or `tp` shard files."""
    full = {k: v.detach().float().contiguous() for k, v in full.items()}
    cfg = replace_config(cfg, [f"parallel.tensor_parallel={tp}"])
    with staged_output(folder, "model", overwrite) as tmp:
        if tp == 1:
            torch.save(full, tmp / MODEL_FILE)
        else:
            for rank, shard in enumerate(split_full(full, cfg.model, tp)):
                torch.save(shard, tmp / SHARD_FILE.format(rank=rank, tp=tp))
        if heads:
            torch.save(heads, tmp / HEADS_FILE)
        if source is not None:
            torch.save(dataclasses.asdict(source), tmp / SOURCE_FILE)
        (tmp / "config.yaml").write_text(cfg.to_yaml())
        yield tmp


def write_model_folder(folder: str | Path, cfg: Config, full: dict[str, torch.Tensor], tp: int = 1,
                       heads: dict[str, torch.Tensor] | None = None, source=None, overwrite: bool = False) -> Path:
    with staged_write(folder, cfg, full, tp, heads, source, overwrite):
        pass
    return Path(folder)


@dataclasses.dataclass
class ModelFolder:
    """What a model folder holds, read back."""

    cfg: Config
    full: dict[str, torch.Tensor]
    """Full (TP=1) fp32 tensors by megamlm parameter name."""
    heads: dict[str, torch.Tensor]
    """fairseq classification heads ({name}.dense.weight, ...); empty if none."""
    source: dict | None
    """The fairseq source's fields (FairseqSource as a dict), for an exact way back; None if none."""


def check_model_folder(folder: str | Path) -> Path:
    """`folder` as a Path if it holds a model folder's config.yaml; else FileNotFoundError, saying what it is."""
    folder = Path(folder)
    if not (folder / "config.yaml").is_file():
        raise FileNotFoundError(f"{folder / 'config.yaml'} not found: not a megamlm model folder (training writes "
                                f"one to <run_dir>/final; `megamlm convert` writes others){what_it_holds(folder)}")
    if (problem := run_folder_problem(folder)) is not None:
        raise FileNotFoundError(problem)
    return folder


def what_it_holds(folder: Path) -> str:
    """What to add where a folder without a config.yaml is something `megamlm convert` reads ("" where not): a
    transformers folder (its config.json), a training checkpoint (its megamlm.json), a run's checkpoints folder."""
    if (folder / "config.json").is_file():
        return (f"; it holds a config.json: a transformers folder? `megamlm convert --from hf {folder} --to megamlm "
                f"OUT` reads it")
    if (folder / CHECKPOINT_META).is_file():
        what, of = "a training checkpoint", "it"
    elif (folder / CHECKPOINT_LATEST).is_file():
        what, of = "a run's checkpoints folder", "its latest checkpoint"
    else:
        return ""
    return f"; it is {what}: `megamlm convert --from zero {folder} --to megamlm OUT` makes a model folder of {of}"


def run_folder_problem(folder: Path) -> str | None:
    """Where a folder with a config.yaml is a training run's (its config.yaml the run's, no weights beside it):
    the line that names its model folder, or how to make one. None for any other folder."""
    if not (folder / RUN_CHECKPOINTS).is_dir() or (folder / MODEL_FILE).is_file():
        return None
    final = folder / RUN_FINAL
    return f"{folder} is a training run's folder, not a model folder: " + (
        f"its model folder is {final}" if (final / "config.yaml").is_file() else
        f"the run has not finished (no {final}); `megamlm convert --from zero {folder} --to megamlm OUT` "
        f"makes a model folder of its latest checkpoint")


def read_model_folder(folder: str | Path) -> ModelFolder:
    """Read (and verify against its record) a model folder written by any TP degree."""
    folder = check_model_folder(folder)
    verify_record(folder)  # every file as written (folders from before records: unverified)
    cfg = load_config([folder / "config.yaml"])
    shards = sorted(folder.glob("model-tp*-of-*.pt"))
    if (folder / MODEL_FILE).is_file():
        full = _load_tensors(folder / MODEL_FILE)
    elif shards:
        tp = int(shards[0].stem.rsplit("-of-", 1)[1])
        expected = [folder / SHARD_FILE.format(rank=r, tp=tp) for r in range(tp)]
        if sorted(expected) != shards:
            raise FileNotFoundError(f"{folder}: expected shard files {[p.name for p in expected]}, "
                                    f"found {[p.name for p in shards]}")
        full = merge_shards([_load_tensors(p) for p in expected], cfg.model)
    else:
        raise _no_weights(folder)
    if full.get(names.CLAP_BETA, torch.ones(1)).dim() == 0:  # CLAP beta was 0-dim in session-1 folders
        full[names.CLAP_BETA] = full[names.CLAP_BETA].reshape(1)
    heads = _load_tensors(folder / HEADS_FILE) if (folder / HEADS_FILE).is_file() else {}
    source = _load_tensors(folder / SOURCE_FILE) if (folder / SOURCE_FILE).is_file() else None
    return ModelFolder(cfg, full, heads, source)


def saved_names(folder: str | Path) -> set[str]:
    """The parameter names a model folder's weights hold (its model file's, or its first TP shard's: every
    shard holds every name), the tensors left unread (memory-mapped)."""
    folder = Path(folder)
    files = [folder / MODEL_FILE] if (folder / MODEL_FILE).is_file() else sorted(folder.glob("model-tp00-of-*.pt"))
    if not files:
        raise _no_weights(folder)
    return set(_load_tensors(files[0], mmap=True))


def _no_weights(folder: Path) -> FileNotFoundError:
    return FileNotFoundError(f"{folder}: neither {MODEL_FILE} nor {SHARD_FILE.format(rank=0, tp=2)}...")


def _load_tensors(path: Path, mmap: bool = False) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises several types on damaged zip archives
        raise CorruptFileError(f"{path} cannot be read ({str(err).splitlines()[0]})") from None


def export_pretrained(model: torch.nn.Module, cfg: Config, folder: str | Path,
                      zero_stage: int = 0, keep=lambda name: True) -> Path:
    """Collective: gather the full model (also from ZeRO-3 partitions); rank 0 writes the
    parameters whose names `keep` accepts."""
    folder = Path(folder)
    gather = contextlib.nullcontext()
    if zero_stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gather:
        full = {name: tensor for name, tensor in full_state_dict(model).items() if keep(name)}
    if dist.get_rank() == 0:
        write_model_folder(folder, cfg, full, overwrite=True)  # <run_dir>/final: this run's own
    barrier()
    return folder
