"""Move parameters between this rank's shards and their full (TP=1) form.

A parameter's sharding is described by megatron's attributes: `tensor_model_parallel` and
`partition_dim`; vocab-parallel tables also carry `vocab_parallel` and are padded with zero rows to
a TP-dependent size, so their full form holds exactly `vocab_size` rows. Because megatron's fused
QKV rows are grouped per head ([q_h; k_h; v_h] for h = 0..H-1), a contiguous split along rows is a
split by heads and the TP=1 layout is the concatenation of the shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megamlm.errors import MegamlmError
from megamlm.model.tp import full_shape, shard, tp_sharded, unshard


class StateDictMismatch(MegamlmError):
    """Weights (a model folder, a checkpoint) whose names are not the model's parameters."""


def to_full(model: nn.Module, param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """This rank's `local` tensor shaped like `param` -> the full tensor (collective over TP)."""
    ctx = model.ctx
    full = local
    if tp_sharded(param) and ctx.tp_size > 1:
        parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
        full = unshard(parts, param.partition_dim, getattr(param, "partition_stride", 1))
    if getattr(param, "vocab_parallel", False):
        full = full[: model.config.vocab_size]
    return full


def from_full(model: nn.Module, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """A full tensor -> this rank's slice shaped like `param` (vocab rows padded with zeros)."""
    ctx = model.ctx
    if getattr(param, "vocab_parallel", False):
        padded = full_shape(param, ctx.tp_size)[0]
        full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
    if tp_sharded(param):
        full = shard(full, param.partition_dim, ctx.tp_size, ctx.tp_rank, getattr(param, "partition_stride", 1))
    return full


def full_state_dict(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) in full TP=1 form, on every rank."""
    out = {}
    for name, param in model.named_parameters():
        local = param.grad if grads else param.detach()
        if local is None:
            local = torch.zeros_like(param)
        out[name] = to_full(model, param, local)
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], keep: set[str] = frozenset()) -> None:
    """Load full (TP=1) tensors into this rank's shards; every parameter must be present, except
    those in `keep`, which stay as they are when absent."""
    params = {name: p for name, p in model.named_parameters() if name in full or name not in keep}
    missing = sorted(set(params) - set(full))
    unexpected = sorted(set(full) - set(params))
    if missing or unexpected:
        raise StateDictMismatch(f"the weights do not match the model: missing {', '.join(missing) or 'none'}; "
                                f"unexpected {', '.join(unexpected) or 'none'}")
    for name, param in params.items():
        local = from_full(model, param, full[name].to(param.dtype))
        if local.shape != param.shape:
            raise StateDictMismatch(f"{name}: expected shard {tuple(param.shape)}, got {tuple(local.shape)}"
                                    f" from full tensor {tuple(full[name].shape)}")
        param.copy_(local)
