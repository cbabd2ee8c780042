"""Per-layer transforms applied to a built model (the model itself knows nothing about them):
activation checkpointing and compilation.

Activation checkpointing: each encoder layer keeps only its input during the forward pass and
recomputes its activations in the backward pass: activation memory per layer drops from
O(b·s·(h + f) + b·np·s²) to O(b·s·h), at the cost of one more layer forward. Recomputation must
draw the same dropout masks as the forward: the default CPU/CUDA generators are replayed by
torch.utils.checkpoint, and the tensor-parallel stream (attention dropout) is replayed here from
the state it had when the layer first ran.
"""

from __future__ import annotations

import contextlib
import functools

import torch._functorch.config
import torch.utils.checkpoint
from torch import nn

from megamlm.model.encoder import Encoder
from megamlm.parallel import tensor_parallel_rng


def _replay_tensor_parallel_rng():
    """(forward context, recompute context) for torch.utils.checkpoint's `context_fn`."""
    saved = tensor_parallel_rng.state_dict()  # captured when the layer's forward starts

    @contextlib.contextmanager
    def replay():
        current = tensor_parallel_rng.state_dict()
        tensor_parallel_rng.load_state_dict(saved)
        try:
            yield
        finally:
            tensor_parallel_rng.load_state_dict(current)

    return contextlib.nullcontext(), replay()


def encoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of every Encoder in `model` (ELECTRA has two: discriminator, generator)."""
    return [layer for module in model.modules() if isinstance(module, Encoder) for layer in module.encoder.layers]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every encoder layer (`encoder_layers`) in the backward pass (parameter names and
    the state dict are unchanged: only each layer's forward is wrapped)."""
    for layer in encoder_layers(model):
        layer.forward = functools.partial(_checkpointed, layer.forward)


def _checkpointed(forward, *args, **kwargs):
    """forward(*args, **kwargs), its activations recomputed in the backward pass. Compiled at TP=1 the
    tensor-parallel stream is not used (parallel.py) and there is nothing to replay."""
    if tensor_parallel_rng.bypassed():
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return _checkpointed_replaying_the_stream(forward, *args, **kwargs)


@torch.compiler.disable
def _checkpointed_replaying_the_stream(forward, *args, **kwargs):
    """torch.compile takes no context_fn but TorchDispatchModes: with TP peers (their own dropout
    streams to replay) a compiled, checkpointed layer runs eagerly (the loop warns)."""
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False,
                                             context_fn=_replay_tensor_parallel_rng, **kwargs)


def records_cuda_graphs(mode: str) -> bool:
    """Whether torch.compile's `mode` (train.compile_mode) records CUDA graphs on a GPU, as torch's own
    table of modes says (reduce-overhead and max-autotune do): the loop then marks a new graph step
    before each micro-batch, whose outputs the next replay would overwrite."""
    from torch._inductor import list_mode_options  # only under train.compile: Inductor takes ~1 s to import

    return bool(list_mode_options(mode).get("triton.cudagraphs", False))


def _no_backward_from_the_autograd_cache() -> None:
    """Turn off AOTAutograd's on-disk cache for what this process compiles. Our custom ops
    (megamlm::triton_attention, megamlm::bias_activation) register backward formulas in Python, which
    AOTAutograd traces into a compiled layer's backward graph but leaves out of that cache's key
    (pytorch#144344): after a change of formula (an edit, or a newer megamlm) a process gets the old
    backward from the cache, and wrong gradients without an error (session 36: the compiled Triton loop's
    first gradient norm 3.65 against 3.36, from a formula of the day before). Without it AOTAutograd
    traces again in every process (seconds); Inductor's cache, keyed on the traced graphs themselves,
    still saves the code generation."""
    torch._functorch.config.enable_autograd_cache = False


def compile_layers(model: nn.Module, mode: str = "default") -> None:
    """torch.compile every encoder layer (`encoder_layers`) in place (parameter names and the state
    dict are unchanged) in torch.compile's `mode` (train.compile_mode). The embedding and head stay
    eager here: the number of masked positions the head projects changes with every batch
    (`compile_head` compiles it with dynamic shapes)."""
    _no_backward_from_the_autograd_cache()
    for layer in encoder_layers(model):
        layer.compile(mode=mode)


def compile_head(model: nn.Module) -> None:
    """torch.compile the MLM head and its loss (`MaskedLM.loss_sum`, train.compile_head) in place, dynamic
    in the number of masked positions, which changes with every batch. The state dict is unchanged."""
    _no_backward_from_the_autograd_cache()
    model.loss_sum = torch.compile(model.loss_sum, dynamic=True)
