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

import torch.utils.checkpoint
from torch import nn

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


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every layer of `model.encoder.layers` in the backward pass (parameter names and
    the state dict are unchanged: only each layer's forward is wrapped)."""
    for layer in model.encoder.layers:
        layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward,
                                          use_reentrant=False, context_fn=_replay_tensor_parallel_rng)


def compile_layers(model: nn.Module) -> None:
    """torch.compile every layer of `model.encoder.layers` in place (parameter names and the state
    dict are unchanged). The embedding and head stay eager: the number of masked positions the head
    projects changes with every batch."""
    for layer in model.encoder.layers:
        layer.compile()
