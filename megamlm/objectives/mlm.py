"""Masked language modeling (RoBERTa; the reference's objective): the first objective.

    logits_local = model(tokens [b, s], target_index [n])     # [n, V_local] this rank's vocab shard
    loss = model.loss(logits_local, targets [n])               # mean CE in nats (vocab-parallel)
    loss_sum = model(tokens, target_index, targets=targets)    # Σ CE [1], model.head_loss decides how
    logits = model.gather_logits(logits_local)                 # [n, vocab_size]
    logits = model(tokens)                                     # [b, s, vocab_size], every position

The head is RoBERTa's (dense -> GELU -> LayerNorm -> tied embedding + bias) or CLAP's
(beta · <h, normalize(E_v)>), both over the vocab-parallel embedding (model/heads.py). Corruption is
dynamic masking (data/masking.py: token, whole_word or span) with the data section's rates.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from megamlm.config import ConfigError, ModelConfig
from megamlm.data.batch import Batch
from megamlm.data.masking import Masker
from megamlm.data.tokenizer import Tokenizer
from megamlm.model import names
from megamlm.model.encoder import Encoder, encoder_flops_per_token, encoder_parameter_count
from megamlm.model.head_loss import fused_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy
from megamlm.model.heads import ClapHead, RobertaLMHead, vocab_padding_bias
from megamlm.model.norm import norm_parameter_count
from megamlm.objectives.base import LossOutput, Objective, register_objective
from megamlm.parallel import ParallelContext, tensor_parallel_shard


def perplexity(loss: float) -> float:
    """exp(MLM loss in nats), capped at e^50 so that a diverged loss still prints as a number."""
    return math.exp(min(loss, 50.0))


def vocab_parallel_loss(logits_local: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy (nats) of [n, V_local] vocabulary shards against targets [n] (real ids), mean, sum or none
    (the [n] losses), over this process's tensor-parallel group (megatron-core's vocab-parallel cross-entropy's
    results, bit for bit: model/head_loss.py)."""
    tp_group, tp_rank = tensor_parallel_shard()
    losses = vocab_parallel_cross_entropy(logits_local, targets, tp_rank * logits_local.size(-1), tp_group)
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.mean()


def select(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Features [s, b, h] at flat (b, s) positions [n] (b_i * s + s_i) -> [n, h]."""
    s = hidden.size(0)
    return hidden[positions % s, positions // s]


class MaskedLM(Encoder):
    """The Encoder plus an MLM head over the vocab-parallel embedding."""

    def __init__(self, model: ModelConfig, ctx: ParallelContext, seed: int = 1,
                 params_dtype: torch.dtype = torch.float32, *, initialize: bool = True):
        """`initialize=False`: a subclass adds heads first and then calls `initialize` (Encoder)."""
        super().__init__(model, ctx, seed, params_dtype, initialize=False)
        vocab_local = self.padded_vocab_size // ctx.tp_size
        self.lm_head = (ClapHead(model, ctx.tp_group) if model.head == "clap"
                        else RobertaLMHead(model, vocab_local, ctx.tp_group))
        self.register_buffer("column_bias", vocab_padding_bias(
            self.embedding.word_embeddings.vocab_start_index, vocab_local, model.vocab_size), persistent=False)
        if initialize:
            self.initialize(seed, params_dtype)

    def external_parameters(self):
        """(module, parameter) pairs a module uses outside its owner's forward (ZeRO-3 must gather
        them): the tied embedding in the head."""
        return [(self.lm_head, self.embedding.word_embeddings.weight)]

    def forward(self, tokens: torch.Tensor, masked_positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, segments: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, host_layout: tuple | None = None) -> torch.Tensor:
        """Training: masked_positions selects positions in row-major (b, s) order, either as a
        [b, s] bool mask or as the [n] flat indices b_i * s + s_i (Batch.target_index: selecting by
        a mask makes the device count it, a host sync in the middle of the forward); the result is
        this rank's vocabulary shard [n, V_local] (padded columns -inf), ready for `loss`, or with
        targets [n] (the real ids at those positions) the summed cross-entropy [1] in nats, computed
        as model.head_loss says. host_layout: Encoder.hidden_states'.
        Inference: without masked_positions, logits at every position over the whole vocabulary,
        [b, s, vocab_size] (gathered over tensor-parallel ranks; differentiable only at TP=1).
        """
        hidden = self.hidden_states(tokens, documents, segments, host_layout=host_layout)  # [s, b, h]
        if masked_positions is None:
            features = hidden.transpose(0, 1).reshape(-1, hidden.size(-1))  # [s, b, h] -> [b*s, h]
        else:
            if masked_positions.dtype == torch.bool:
                masked_positions = masked_positions.flatten().nonzero().squeeze(1)
            features = select(hidden, masked_positions)
        if targets is not None:
            return self.loss_sum(features, targets)
        logits = self.lm_head(features, self.embedding.word_embeddings.weight, self.column_bias)
        if masked_positions is None:
            # [b*s, V] -> [b, s, V]
            return self.gather_logits(logits).view(*tokens.shape, -1)
        return logits

    def loss_sum(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Σ cross-entropy [1] (nats) of the head at features [n, h] against targets [n]."""
        table = self.embedding.word_embeddings
        if self.config.head_loss == "fused":
            fused = functools.partial(fused_vocab_parallel_cross_entropy, targets=targets,
                                      vocab_start=table.vocab_start_index, tp_group=self.ctx.tp_group,
                                      chunk_elements=self.config.head_loss_chunk)
            return self.lm_head(features, table.weight, self.column_bias, project=fused).reshape(1)
        return self.loss(self.lm_head(features, table.weight, self.column_bias), targets, "sum").reshape(1)

    def loss(self, logits_local: torch.Tensor, targets: torch.Tensor,
             reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy (nats) over the selected positions, mean or sum; targets [n] are real ids."""
        return vocab_parallel_loss(logits_local, targets, reduction)

    def gather_logits(self, logits_local: torch.Tensor) -> torch.Tensor:
        """[..., V_local] shards -> [..., vocab_size] on every rank (padding columns dropped), for
        evaluation and inference (megatron's gather allocates on CUDA, this one on any device)."""
        if self.ctx.tp_size == 1:
            return logits_local[..., : self.config.vocab_size]
        with torch.no_grad():
            shards = [torch.empty_like(logits_local) for _ in range(self.ctx.tp_size)]
            dist.all_gather(shards, logits_local.contiguous(), group=self.ctx.tp_group)
            return torch.cat(shards, dim=-1)[..., : self.config.vocab_size]


def mlm_head_parameter_count(model: ModelConfig, input_size: int | None = None) -> int:
    """Parameters of the MLM head (the tied table not counted again); `input_size`: its features'
    width when not the model's (ELECTRA's generator)."""
    h, e, V = model.hidden_size, model.embedding_dim, model.vocab_size
    if model.head == "clap" and input_size is None:
        return 1
    dense = (input_size or h) * e + (e if model.bias else 0)
    return dense + norm_parameter_count(model, e) + V + (0 if model.tie_embeddings else V * e)


def mlm_head_flops_per_token(model: ModelConfig, head_fraction: float) -> float:
    """Forward + backward FLOPs per token of the MLM head: 6·(h·e [RoBERTa's dense] + e·V) on the
    share of positions it projects (e = h unless factorized, ALBERT)."""
    h, e = model.hidden_size, model.embedding_dim
    return 6 * ((h * e if model.head == "roberta" else 0) + e * model.vocab_size) * head_fraction


def has_masked_lm_head(names_: set[str] | dict) -> bool:
    """Whether a model's parameter names hold the MLM head (a folder read from a classifier or a bare encoder
    has none)."""
    return any(name.startswith(names.LM_HEAD_PREFIX) for name in names_)


@register_objective
class MaskedLanguageModeling(Objective):
    """objective.name=mlm: cross-entropy over the masked positions (fairseq masked_lm)."""

    name = "mlm"

    def unsupported_here(self) -> str | None:
        return MaskedLM.unsupported_here(self.cfg.model)

    conversion_targets = ("megamlm", "fairseq", "hf")

    def build_model(self, ctx: ParallelContext, params_dtype: torch.dtype = torch.float32) -> MaskedLM:
        return MaskedLM(self.cfg.model, ctx, seed=self.cfg.train.seed, params_dtype=params_dtype)

    def build_pretrained(self, ctx: ParallelContext, saved: set[str]) -> MaskedLM:
        """The MaskedLM; a folder without its head (read from a *ForSequenceClassification) is refused."""
        if not has_masked_lm_head(saved):
            raise ConfigError("this model folder holds no masked-LM head (it was read from a "
                              "*ForSequenceClassification): `megamlm glue` fine-tunes or scores it, `megamlm convert "
                              "--to hf --classification-head NAME` writes it back")
        return self.build_model(ctx)

    def corruption(self, tokenizer: Tokenizer, seed: int) -> Masker:
        d, dictionary = self.cfg.data, tokenizer.dictionary
        if d.masking != "token" and tokenizer.word_starts() is None:
            raise ConfigError(f"data.masking={d.masking} needs word boundaries, but data.tokenizer={d.tokenizer} "
                              f"has no word-start rule (no piece begins with the space marker Ġ); use "
                              f"data.masking=token")
        return Masker(dictionary.mask_id, dictionary.ordinary_ids(), d.mask_prob, d.leave_unmasked_prob,
                      d.random_token_prob, seed=seed, strategy=d.masking, word_starts=tokenizer.word_starts(),
                      span_p=d.span_p, span_max_words=d.span_max_words)

    def loss(self, model, batch: Batch) -> LossOutput:
        loss_sum = model(batch.inputs, batch.target_index, batch.documents, batch.segments, targets=batch.targets,
                         host_layout=batch.host_layout)
        return LossOutput(loss_sum, self.count(batch), {})

    def parameter_count(self) -> int:
        return encoder_parameter_count(self.cfg.model) + mlm_head_parameter_count(self.cfg.model)

    def flops_per_token(self, seq_length: int) -> float:
        model = self.cfg.model
        return encoder_flops_per_token(model, seq_length) + mlm_head_flops_per_token(model, self.cfg.data.mask_prob)

    def summary(self, terms: dict[str, float]) -> dict[str, float]:
        return {"ppl": perplexity(terms["mlm"])}

    def log_values(self, model: MaskedLM) -> dict[str, float]:
        return {"beta": float(model.lm_head.beta.item())} if self.cfg.model.head == "clap" else {}
