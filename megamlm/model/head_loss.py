"""The head's vocabulary projection fused with the vocab-parallel cross-entropy (model.head_loss=fused).

    loss_sum = fused_vocab_parallel_cross_entropy(x [n, h], weight [V_local, h], bias [V_local], targets [n])
             = Σ_i CE(x_i · weightᵀ + bias, targets_i) over the whole (tensor-parallel) vocabulary, in nats

The unfused path materializes the logits [n, V_local] in the compute dtype, its cross-entropy works on an
fp32 tensor of them (logits - max) and keeps the softmax for backward: [n, V_local] buffers, the largest
tensors of a training step at V = 50,265. Here the masked positions go through in chunks of rows
(model.head_loss_chunk logit elements each); per chunk the logits are computed, reduced over the TP group
(max, then Σexp and the target's logit: megatron's order of operations), and turned into the gradient
of the summed loss at once (softmax - one-hot), which is multiplied into the three gradients
(x, weight, bias) before the chunk is dropped. Forward therefore runs the head's three matmuls and
backward only scales the stored gradients by the incoming scalar: no [n, V_local] tensor outlives a
chunk, and nothing is recomputed. Under torch.no_grad (validation) only the logits matmul runs.

The unfused path's loss (`vocab_parallel_cross_entropy`, on logits the head formed) does the same arithmetic
as megatron-core's vocab-parallel cross-entropy, bit for bit, with fewer passes over the [n, V_local]
logits: fp32 logits are not copied to work in place on (the subtraction of the max writes a new tensor), and
the max comes without its indices (7x faster on a CPU). Both paths share the per-shard arithmetic
(`shard_cross_entropy`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


def rows_per_chunk(columns: int, chunk_elements: int) -> int:
    """Rows of a [rows, columns] chunk of at most chunk_elements elements (at least one row)."""
    return max(1, chunk_elements // columns)


def _all_reduce(tensor: torch.Tensor, op, tp_group) -> torch.Tensor:
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(tensor, op=op, group=tp_group)
    return tensor


class ShardCrossEntropy(NamedTuple):
    """`shard_cross_entropy`'s results for n rows of logits over a vocabulary shard of V_local columns."""

    losses: torch.Tensor
    """[n] fp32: CE in nats over the whole (tensor-parallel) vocabulary."""
    softmax: torch.Tensor | None
    """[n, V_local] fp32 (None where not asked for): this shard's probabilities, in the buffer the
    shifted logits had."""
    local_target: torch.Tensor
    """[n]: each target's column in this shard (clamped into it where the target is another shard's)."""
    in_shard: torch.Tensor
    """[n] bool: the target is in this shard."""


def cross_entropy_gradient(softmax: torch.Tensor, local_target: torch.Tensor, in_shard: torch.Tensor) -> torch.Tensor:
    """d Σ CE / d logits = softmax - one-hot(target), [n, V_local] fp32, in the softmax's buffer
    (`ShardCrossEntropy`'s last three fields)."""
    rows = torch.arange(softmax.size(0), device=softmax.device)
    softmax[rows, local_target] -= in_shard.to(softmax.dtype)
    return softmax


def shard_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, tp_group,
                        softmax: bool, reuse: bool = False) -> ShardCrossEntropy:
    """Cross-entropy of logits [n, V_local] (any float dtype; this rank's vocabulary shard, starting at id
    vocab_start) against targets [n] (real ids), reduced over the TP group in megatron-core's order of
    operations: the max (all-reduced), logits - max in fp32, the target's shifted logit, exp, Σexp
    (the target's logit and Σexp all-reduced at once), loss = log Σexp - target's; with `softmax`, also
    exp / Σexp. reuse: fp32 logits are the caller's buffer to work in (else the subtraction makes a new one;
    16-bit logits are converted into a new one, which a subtraction of mixed dtypes does slowly on a CPU)."""
    n, vocab_local = logits.shape
    logits_max = _all_reduce(logits.amax(dim=-1).float(), dist.ReduceOp.MAX, tp_group)
    shifted = logits.float()  # [n, V_local] fp32
    if shifted is logits and not reuse:
        shifted = logits - logits_max.unsqueeze(-1)
    else:
        shifted.sub_(logits_max.unsqueeze(-1))
    local_target = targets - vocab_start
    in_shard = (local_target >= 0) & (local_target < vocab_local)
    local_target = local_target.clamp(0, vocab_local - 1)
    rows = torch.arange(n, device=logits.device)
    predicted = torch.where(in_shard, shifted[rows, local_target], 0.0)
    exp = shifted.exp_()  # [n, V_local] exp(logit - max)
    # [2, n]: the target's logit and Σexp, summed over the vocabulary shards in one all-reduce
    reduced = _all_reduce(torch.stack([predicted, exp.sum(dim=-1)]), dist.ReduceOp.SUM, tp_group)
    predicted, sum_exp = reduced[0], reduced[1]
    losses = torch.log(sum_exp) - predicted
    probabilities = exp.div_(sum_exp.unsqueeze(-1)) if softmax else None
    return ShardCrossEntropy(losses, probabilities, local_target, in_shard)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """CE [n] of logits [n, V_local] formed elsewhere (the unfused head), vocab-parallel: megatron-core's
    `vocab_parallel_cross_entropy`'s results and gradient, bit for bit, without its fp32 copy of the logits."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, tp_group):
        result = shard_cross_entropy(logits, targets, vocab_start, tp_group, softmax=ctx.needs_input_grad[0])
        if result.softmax is not None:  # it becomes the gradient in place (a second backward is not supported)
            ctx.save_for_backward(result.softmax, result.local_target, result.in_shard)
        ctx.dtype = logits.dtype
        return result.losses

    @staticmethod
    def backward(ctx, grad_losses):
        grad = cross_entropy_gradient(*ctx.saved_tensors)  # [n, V_local] fp32
        return grad.mul_(grad_losses.unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 tp_group) -> torch.Tensor:
    """CE [n] (nats, fp32) of logits [n, V_local], this rank's shard of the vocabulary starting at id
    vocab_start, against targets [n] real ids, over the whole vocabulary (`VocabParallelCrossEntropy`)."""
    return VocabParallelCrossEntropy.apply(logits, targets, vocab_start, tp_group)


class FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """Σ CE over vocabulary shards, gradients formed chunk by chunk in forward (see module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, vocab_start, tp_group, chunk_rows):
        n = x.size(0)
        wants = ctx.needs_input_grad[:3]
        # the accumulators start empty: the first chunk writes them, the others add (fp32 for the
        # weight and bias: chunks' contributions are summed in full precision, cast once at the end)
        grad_x = torch.zeros_like(x) if wants[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants[1] and n == 0 else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants[2] and n == 0 else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, n, chunk_rows):
            x_c, target_c = x[start:start + chunk_rows], targets[start:start + chunk_rows]
            logits = torch.nn.functional.linear(x_c, weight, bias).float()  # [c, V_local]
            result = shard_cross_entropy(logits, target_c, vocab_start, tp_group, softmax=any(wants), reuse=True)
            loss_sum += result.losses.sum()
            if not any(wants):
                continue
            grad_logits = cross_entropy_gradient(*result[1:])  # [c, V_local] fp32, in the logits' memory
            del result
            if wants[2]:  # Σ over the chunk's rows as a matrix-vector product (a column sum is slow on CPU)
                column_sum = grad_logits.t() @ grad_logits.new_ones(len(x_c))
                grad_bias = column_sum if grad_bias is None else grad_bias.add_(column_sum)
            grad_logits = grad_logits.to(x.dtype)
            if wants[0]:
                torch.mm(grad_logits, weight.to(x.dtype), out=grad_x[start:start + chunk_rows])  # [c, V_l] @ [V_l, h]
            if wants[1]:
                if grad_weight is None:
                    grad_weight = (grad_logits.t() @ x_c).float()  # [V_l, c] @ [c, h]
                elif grad_weight.dtype == x.dtype:
                    grad_weight.addmm_(grad_logits.t(), x_c)  # no [V_local, h] temporary per chunk
                else:
                    grad_weight.add_((grad_logits.t() @ x_c).float())
            del logits, grad_logits  # before the next chunk's logits exist
        # kept on ctx, not saved for backward: backward scales them in place (they are no inputs or outputs)
        ctx.grads = (grad_x, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, bias.dtype)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight, grad_bias = ctx.grads
        del ctx.grads  # a second backward through this graph is not supported (nor needed)
        scale = grad_loss.float()
        return (None if grad_x is None else grad_x.mul_(scale.to(grad_x.dtype)),
                None if grad_weight is None else grad_weight.mul_(scale).to(ctx.dtypes[0]),
                None if grad_bias is None else grad_bias.mul_(scale).to(ctx.dtypes[1]),
                None, None, None, None)


def fused_vocab_parallel_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                                       targets: torch.Tensor, vocab_start: int, tp_group,
                                       chunk_elements: int) -> torch.Tensor:
    """Σ_i CE(x_i · weightᵀ + bias, targets_i) in nats (fp32 scalar) over vocabulary shards: x [n, h] the
    same on every TP rank, weight [V_local, h] and bias [V_local] this rank's shard starting at id
    vocab_start, targets [n] real ids. Exact to `vocab_parallel_loss(F.linear(x, weight, bias), targets,
    "sum")` up to floating-point order; chunk_elements bounds each chunk's [rows, V_local] logits."""
    chunk_rows = rows_per_chunk(weight.size(0), chunk_elements)
    return FusedVocabParallelCrossEntropy.apply(x, weight, bias, targets, vocab_start, tp_group, chunk_rows)
