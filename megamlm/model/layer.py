"""The encoder layers as megatron-core ModuleSpecs: bidirectional attention, post- or pre-LN.

megatron-core ships pre-LN layers only. RoBERTa is post-LN:
    x = LN(x + dropout(attention(x)));  x = LN(x + dropout(mlp(x)))
`PostLNTransformerLayer` reuses megatron's TransformerLayer unchanged for attention, MLP and
bias-dropout-add, with empty (identity) pre-norm slots, and only appends the two LayerNorms after
the residual adds. No megatron code is copied.

Each layer has a spec of its own (`encoder_block_spec`): its attention pattern (ModelConfig.layer_attention:
global, a window or BigBird's for local layers, ModernBERT's alternation) is a parameter of its core
attention, and ModernBERT's layer 0 has no pre-attention norm (model.first_layer_norm).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megamlm.config import GLOBAL_ATTENTION, LayerAttention, ModelConfig
from megamlm.model.attention import AttentionBackend, LayerInputs, split_qkv
from megamlm.model.bias_activation import bias_activation
from megamlm.model.dropout import dropout
from megamlm.model.norm import norm_spec
from megamlm.model.positions import apply_rotation


@dataclasses.dataclass
class PostLNTransformerLayerSubmodules(TransformerLayerSubmodules):
    """TransformerLayer's slots plus the LayerNorms that follow each residual add."""

    post_attention_layernorm: ModuleSpec | type = IdentityOp
    post_mlp_layernorm: ModuleSpec | type = IdentityOp


class PostLNTransformerLayer(TransformerLayer):
    """megatron-core TransformerLayer with LayerNorm after the residual adds (fairseq/BERT)."""

    def __init__(self, config, submodules: PostLNTransformerLayerSubmodules, **kwargs):
        super().__init__(config=config, submodules=submodules, **kwargs)
        norm_args = dict(config=self.config, hidden_size=self.config.hidden_size,
                         eps=self.config.layernorm_epsilon)
        self.post_attention_layernorm = build_module(submodules.post_attention_layernorm, **norm_args)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm_args)

    def _forward_attention(self, *args, **kwargs):
        hidden_states, context = super()._forward_attention(*args, **kwargs)
        return self.post_attention_layernorm(hidden_states), context

    def _forward_post_mlp(self, mlp_output_with_bias, residual):
        return self.post_mlp_layernorm(super()._forward_post_mlp(mlp_output_with_bias, residual))


class UnsplitQKVSelfAttention(SelfAttention):
    """megatron-core's SelfAttention handing its core attention (BidirectionalAttention) the QKV projection
    unsplit, [s, b, np, 3 · hn] as the query, key and value None. Split into three by megatron, their
    gradients are concatenated back into that layout after the attention's backward (a copy of the
    projection's output per layer: 1.6 ms of an update's 152 ms of kernels, base at 2048 on the H200);
    unsplit, a backend whose kernels write the three gradients into one tensor of that layout
    (model.attention_backend=triton) leaves nothing to concatenate. megatron-core's own unsplit form
    (split_qkv=False, its fused-RoPE path's) is the same tensor; our RoPE is applied in the core attention."""

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        # [s, b, h] -> [s, b, np, 3 hn]: each head's query, key and value side by side
        mixed_qkv, _ = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate,
                                                           split_qkv=False)
        return mixed_qkv, None, None


class BidirectionalAttention(MegatronModule):
    """megatron's core-attention slot (attention.py's module docstring): permutes to [b, np, s, hn], lets the
    backend attend. It takes query, key and value [s, b, np, hn], or (UnsplitQKVSelfAttention) the QKV
    projection unsplit as the query, [s, b, np, 3 · hn], key and value None: a backend may then attend
    without splitting it."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, *, backend: AttentionBackend,
                 pattern: LayerAttention = GLOBAL_ATTENTION):
        super().__init__(config=config)
        self.backend = backend
        self.pattern = pattern
        """This layer's attention pattern; its key into the prepared LayerInputs."""
        self.dropout_p = config.attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        s, b, np_local, _ = query.shape
        inputs: LayerInputs = attention_mask[self.pattern]
        dropout_p = self.dropout_p if self.training else 0.0
        if key is None and inputs.rotation is None:
            # [s, b, np, 3 hn] -> [b, np, s, 3 hn]
            out = self.backend.attend_unsplit(query.permute(1, 2, 0, 3), inputs.attention, dropout_p,
                                              self.softmax_scale)
        else:
            # [s, b, np, 3 hn] -> 3 x [s, b, np, hn]; each [s, b, np, hn] -> [b, np, s, hn]
            heads = split_qkv(query) if key is None else (query, key, value)
            q, k, v = (t.permute(1, 2, 0, 3) for t in heads)
            if inputs.rotation is not None:
                q, k = (apply_rotation(t, *inputs.rotation) for t in (q, k))
            out = self.backend.attend(q, k, v, inputs.attention, dropout_p, self.softmax_scale)
        # [b, np, s, hn] -> [s, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class TensorParallelLinear:
    """What our two megatron-core tensor-parallel linears below change.

    With one TP rank their forward is `x · wᵀ (+ b unless skip_bias_add)` in plain autograd ops: the
    same products forward and backward (g · w and gᵀ · x, as torch's mm backward computes them;
    bit-identical on CPU, tested) without megatron's three autograd.Functions per linear (the matmul,
    and the region copy / reduce that are identities at one rank), whose Python made an eager step's
    host time 1.5x transformers' (benchmarks/host_overhead.py). With peers, or with a megatron feature
    that needs its Functions (frozen weight, gradient-accumulation fusion, sequence parallelism, CPU
    offloading, deferred embedding wgrad), megatron's own forward runs. There, megatron-core 0.16's
    RowParallelLinear hands its matmul tp_group=None, which makes it look the group up and call
    warnings.warn (a deprecation notice) on every forward; torch.compile cannot trace warnings.warn,
    so the layer's own group is passed (it only matters with sequence parallelism or a dgrad
    all-reduce)."""

    one_rank_fast_path = True
    """Class switch for benchmarks/host_overhead.py and the tests, which compare with megatron's path."""

    def _one_rank(self) -> bool:
        """Whether megatron's forward would reduce to the plain matmul."""
        return (self.one_rank_fast_path and self.tp_group.size() == 1 and self.weight.requires_grad
                and not (self.sequence_parallel or self.gradient_accumulation_fusion or self.explicit_expert_comm
                         or self.config.defer_embedding_wgrad_compute)
                and self.config._cpu_offloading_context is None)

    def _plain_forward(self, input_):
        """megatron's (output, output_bias) at one rank: [s, b, h_in] x [h_in, h_out] -> [s, b, h_out]."""
        if self.skip_bias_add or self.bias is None:
            return torch.matmul(input_, self.weight.t()), self.bias if self.skip_bias_add else None
        if input_.is_cuda:
            # the bias inside the matmul (one addmm: cuBLASLt's bias epilogue), where megatron's matmul and add
            # take one more pass over the output, the QKV projection's: 1.7 ms of an update's kernels, base at
            # 2048 on the H200. Not on the CPU: no faster there, and in bf16 its one rounding of the sum would
            # change megatron's numbers (two roundings), which the CPU keeps to the last bit
            return torch.nn.functional.linear(input_, self.weight, self.bias), None
        return torch.matmul(input_, self.weight.t()) + self.bias, None

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


class ColumnLinear(TensorParallelLinear, ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear, plain at one rank (`TensorParallelLinear`)."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is None and self._one_rank():
            return self._plain_forward(input_)
        return super().forward(input_, weight, runtime_gather_output)


class BiasActivationLinear(ColumnLinear):
    """The FFN's first linear under model.bias_activation=triton: its output is activation(x · wᵀ + b), the
    bias and the activation in one op (model/bias_activation.py), and megatron's MLP applies the identity
    (transformer_config's activation_func). Not for gated FFNs (the config refuses them)."""

    def __init__(self, *args, activation: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.activation = activation

    def forward(self, input_, weight=None, runtime_gather_output=None):
        # [s, b, h] -> [s, b, ffn / tp], the bias apart (megatron's MLP builds linear_fc1 with skip_bias_add)
        output, bias = super().forward(input_, weight, runtime_gather_output)
        return bias_activation(output, bias, self.activation), None


class RowLinear(TensorParallelLinear, RowParallelLinear):
    """megatron-core's RowParallelLinear, plain at one rank (`TensorParallelLinear`)."""

    def forward(self, input_):
        if self.input_is_parallel and self._one_rank():
            return self._plain_forward(input_)
        return super().forward(input_)


def bias_dropout_add(training: bool, fused: bool):
    """The layer's bias-dropout-add slot (megatron's get_bias_dropout_add signature) with our
    dropout, which is 3-8x cheaper on CPU: residual + dropout(x + bias)."""

    def apply(x_with_bias, residual, prob):
        x, bias = x_with_bias
        if bias is not None:
            x = x + bias
        # under autocast x is half precision and the residual fp32; the stream stays in x's dtype
        return residual.to(x.dtype) + dropout(x, prob, training)

    return apply


def encoder_block_spec(model: ModelConfig, backend: AttentionBackend) -> TransformerBlockSubmodules:
    """Every layer's spec (one for a shared layer) and the final norm's (built by pre-LN blocks)."""
    patterns = model.layer_attention()[:1] if model.share_layers else model.layer_attention()
    layers = [encoder_layer_spec(model, backend, pattern, first=i == 0) for i, pattern in enumerate(patterns)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm_spec(model))


def encoder_layer_spec(model: ModelConfig, backend: AttentionBackend, pattern: LayerAttention = GLOBAL_ATTENTION,
                       first: bool = False) -> ModuleSpec:
    """One layer: our core attention running `backend` (one instance shared by every layer) with
    `pattern` (global by default), megatron's TP linears, the norms' placement."""
    norm = norm_spec(model)
    core_attention = functools.partial(BidirectionalAttention, backend=backend, pattern=pattern)
    self_attention = ModuleSpec(
        module=UnsplitQKVSelfAttention,
        params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnLinear,
            core_attention=core_attention,
            linear_proj=RowLinear,
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )
    fc1 = (ColumnLinear if model.bias_activation == "torch" else
           ModuleSpec(module=BiasActivationLinear, params={"activation": model.activation}))
    # megatron-core takes the FFN width from the config only as a deprecated fallback (a warning per layer)
    mlp = ModuleSpec(module=MLP, params={"ffn_hidden_size": model.ffn_hidden_size},
                     submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=RowLinear))
    if model.layernorm == "post":
        return ModuleSpec(
            module=PostLNTransformerLayer,
            submodules=PostLNTransformerLayerSubmodules(
                self_attention=self_attention,
                self_attn_bda=bias_dropout_add,
                post_attention_layernorm=norm,
                mlp=mlp,
                mlp_bda=bias_dropout_add,
                post_mlp_layernorm=norm,
            ),
        )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm if model.first_layer_norm or not first else IdentityOp,
            self_attention=self_attention,
            self_attn_bda=bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=bias_dropout_add,
        ),
    )
