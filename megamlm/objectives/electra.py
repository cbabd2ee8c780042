"""ELECTRA replaced-token detection (Clark et al. 2020): objective.name=electra.

    generator:     masked inputs -> the shared embedding -> a narrower encoder -> MLM head (tied)
    sampling:      replacements ~ softmax(generator logits) at the masked positions (no gradient)
    discriminator: the inputs with the replacements -> the same embedding -> the encoder -> one logit
                   per token: replaced or original (a sample equal to the original counts as original)
    loss = generator MLM (mean over masked tokens) + λ · binary cross-entropy (mean over real tokens)

The discriminator is the model (an Encoder whose parameters keep their names: GLUE, model folders and
`megamlm params` read it like any encoder); the generator is `generator.*`, the same depth, a fraction
(objective.generator_size) of the width, and reads the discriminator's token embedding (and its
position table, when learned), as in the paper. Exported folders drop it unless
objective.export_generator.

Tensor parallelism: the generator's logits stay vocab-parallel [n, V_local]. Sampling is Gumbel-max per
shard: every rank draws the same uniform noise for the whole vocabulary (seeded by the run's seed and
the micro-batch's first sample), keeps its own columns, takes its best (score, id), and the ranks agree
on the best of those; so TP=1 and TP=2 draw the same replacements, and no [n, V] is gathered.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megamlm.config import Config, ConfigError, ModelConfig
from megamlm.data.batch import Batch
from megamlm.model import names
from megamlm.model.activation import activation_function
from megamlm.model.encoder import Encoder, encoder_flops_per_token, encoder_parameter_count
from megamlm.model.heads import RobertaLMHead, vocab_padding_bias
from megamlm.objectives.base import LossOutput, register_objective
from megamlm.objectives.mlm import (
    MaskedLanguageModeling,
    mlm_head_parameter_count,
    perplexity,
    vocab_parallel_loss,
)
from megamlm.parallel import ParallelContext

AUC_BINS = torch.linspace(-16.0, 16.0, 129)
"""Bin edges over the discriminator's logit for the AUC histogram (width 0.25; outside: clamped)."""


def generator_config(model: ModelConfig, size: float) -> ModelConfig:
    """The generator's model section: `size` of the discriminator's heads (at least one), the same
    head size, FFN in the same ratio to the hidden size, the same depth."""
    heads = max(1, round(model.num_attention_heads * size))
    return dataclasses.replace(model, num_attention_heads=heads, hidden_size=heads * model.head_dim,
                               ffn_hidden_size=model.ffn_hidden_size * heads // model.num_attention_heads)


class ReplacedTokenHead(nn.Module):
    """The discriminator's head (HF ElectraDiscriminatorPredictions): dense -> model.activation (its
    hidden_act; GELU in ELECTRA) -> one logit."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(model.hidden_size, model.hidden_size)
        self.activation = activation_function(model)
        self.prediction = nn.Linear(model.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [b, s] logits of "replaced"."""
        # [s, b, 1] -> [b, s]
        return self.prediction(self.activation(self.dense(hidden))).squeeze(-1).transpose(0, 1).contiguous()


class ElectraOutput(NamedTuple):
    generator_logits: torch.Tensor
    """[n, V_local] the generator's logits at the masked positions (this rank's vocabulary shard)."""
    discriminator_logits: torch.Tensor
    """[b, s] the discriminator's logit of "replaced" at every position."""
    corrupted: torch.Tensor
    """[b, s] what the discriminator read: the original text with the samples at the masked positions."""


@torch.no_grad()
def sample_vocab_parallel(logits_local: torch.Tensor, vocab_start: int, vocab_size: int, seed: int,
                          tp_group=None, chunk_elements: int = 1 << 24) -> torch.Tensor:
    """Ids [n] ~ softmax(logits) from vocabulary shards [n, V_local] by Gumbel-max, the same at any TP
    degree: the noise is drawn for the whole (unpadded) vocabulary on every rank, in row chunks of a
    size that does not depend on TP, and each rank adds its own columns' share."""
    n, vocab_local = logits_local.shape
    real_local = max(0, min(vocab_local, vocab_size - vocab_start))  # columns that are not padding
    generator = torch.Generator(device=logits_local.device).manual_seed(seed)
    rows = max(1, chunk_elements // vocab_size)
    values, ids = [], []
    for start in range(0, n, rows):
        chunk = logits_local[start:start + rows]
        uniform = torch.rand(len(chunk), vocab_size, generator=generator, device=chunk.device)
        # Gumbel(0, 1) = -log(-log u); u = 0 (probability 2^-24) clamped to the smallest float
        gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float32).tiny)))
        scores = chunk[:, :real_local].float() + gumbel[:, vocab_start:vocab_start + real_local]
        if real_local == 0:  # a shard of padding only
            scores = chunk.new_full((len(chunk), 1), float("-inf"), dtype=torch.float32)
        value, index = scores.max(-1)
        values.append(value)
        ids.append(index + vocab_start)
    value, index = torch.cat(values), torch.cat(ids)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    if tp_size == 1:
        return index
    # [n] per rank -> [tp, n]; the best score wins, ties to the lowest rank (= lowest id, as at TP=1)
    all_values = [torch.empty_like(value) for _ in range(tp_size)]
    all_ids = [torch.empty_like(index) for _ in range(tp_size)]
    dist.all_gather(all_values, value, group=tp_group)
    dist.all_gather(all_ids, index, group=tp_group)
    best = torch.stack(all_values).argmax(0)  # first maximum: the lowest rank
    return torch.stack(all_ids).gather(0, best[None]).squeeze(0)


class ElectraModel(Encoder):
    """The discriminator (this Encoder) with its replaced-token head, and `generator` (None: a
    discriminator alone, e.g. read from an exported folder)."""

    def __init__(self, model: ModelConfig, generator: ModelConfig | None, ctx: ParallelContext,
                 seed: int = 1, params_dtype: torch.dtype = torch.float32):
        super().__init__(model, ctx, seed, params_dtype, initialize=False)
        self.discriminator_head = ReplacedTokenHead(model)
        vocab_local = self.padded_vocab_size // ctx.tp_size
        self.generator = None
        if generator is not None:
            self.generator = Encoder(generator, ctx, seed, params_dtype, initialize=False,
                                     input_size=model.embedding_dim)
            self.generator.lm_head = RobertaLMHead(model, vocab_local, ctx.tp_group, input_size=generator.hidden_size)
        # the generator never predicts (nor samples) padding: the discriminator would read it as padding
        start = self.embedding.word_embeddings.vocab_start_index
        bias = vocab_padding_bias(start, vocab_local, model.vocab_size)
        if start <= model.pad_token_id < start + vocab_local:
            bias[model.pad_token_id - start] = float("-inf")
        self.register_buffer("column_bias", bias, persistent=False)
        self.initialize(seed, params_dtype)

    def external_parameters(self):
        """(module, parameter) pairs used outside their owner's forward: the tied table in the generator's head."""
        return [] if self.generator is None else [(self.generator.lm_head, self.embedding.word_embeddings.weight)]

    def forward(self, inputs: torch.Tensor, original: torch.Tensor, target_index: torch.Tensor,
                sampling_seed: int, documents: torch.Tensor | None = None,
                segments: torch.Tensor | None = None, host_layout: tuple | None = None) -> ElectraOutput:
        """inputs (masked) and original [b, s], target_index [n] flat masked positions -> ElectraOutput.
        host_layout: of `inputs` (Encoder.hidden_states'); the corrupted text has the same padding (the
        generator never samples it)."""
        logits = self.generator_logits(inputs, target_index, documents, segments, host_layout)
        samples = sample_vocab_parallel(logits.detach(), self.embedding.word_embeddings.vocab_start_index,
                                        self.config.vocab_size, sampling_seed, self.ctx.tp_group)
        corrupted = original.flatten().index_copy(0, target_index, samples).view_as(original)
        hidden = self.hidden_states(corrupted, documents, segments, host_layout=host_layout)  # [s, b, h]
        return ElectraOutput(logits, self.discriminator_head(hidden), corrupted)


    def generator_logits(self, inputs: torch.Tensor, index: torch.Tensor, documents: torch.Tensor | None = None,
                         segments: torch.Tensor | None = None, host_layout: tuple | None = None) -> torch.Tensor:
        """[n, V_local] the generator's logits at the flat positions `index` [n] (b · s + position) of
        inputs [b, s]; padding's column is -inf."""
        if self.generator is None:
            raise ConfigError("this ELECTRA model has no generator (an exported discriminator): training and "
                              "MLM scoring need one (export with objective.export_generator=true)")
        s = inputs.size(1)
        padding = inputs.eq(self.config.pad_token_id)
        embedded = self.embedding(inputs, padding, segments)  # [s, b, h], shared with the discriminator
        hidden = self.generator.hidden_states(inputs, documents, segments, embedded=embedded,
                                              host_layout=host_layout)  # [s, b, h_g]
        features = hidden[index % s, index // s]  # [n, h_g]
        return self.generator.lm_head(features, self.embedding.word_embeddings.weight, self.column_bias)


def has_generator(names_: set[str] | dict) -> bool:
    """Whether a model's parameter names hold the generator (exported folders may leave it out)."""
    return any(name.startswith(names.GENERATOR_PREFIX) for name in names_)


def roc_auc(histogram: torch.Tensor) -> float:
    """AUC from [2, bins] counts of (original, replaced) tokens per score bin (ascending): P(a replaced
    token scores above an original one), ties within a bin counted half."""
    negative, positive = histogram[0].double(), histogram[1].double()
    if negative.sum() == 0 or positive.sum() == 0:
        return float("nan")
    below = torch.cumsum(negative, 0) - negative  # originals in lower bins
    return float((positive * (below + 0.5 * negative)).sum() / (positive.sum() * negative.sum()))


@register_objective
class Electra(MaskedLanguageModeling):
    """objective.name=electra. Corruption is MLM's (data.mask_prob, data.masking; the paper keeps 15%
    of the masked tokens unchanged and replaces none at random: configs/objectives/electra.yaml)."""

    name = "electra"
    loss_terms = ("generator", "discriminator")
    conversion_targets = ("megamlm", "hf")
    """Between megamlm folders, and from / to transformers' ElectraForPreTraining (the discriminator)."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.generator = generator_config(cfg.model, cfg.objective.generator_size)
        tp = cfg.parallel.tensor_parallel
        if self.generator.num_attention_heads % tp:
            raise ConfigError(
                f"objective.generator_size={cfg.objective.generator_size} gives the generator "
                f"{self.generator.num_attention_heads} attention head(s), not divisible by "
                f"parallel.tensor_parallel={tp}; choose a size that gives a multiple of {tp}")

    def build_model(self, ctx: ParallelContext, params_dtype: torch.dtype = torch.float32,
                    generator: bool = True) -> ElectraModel:
        return ElectraModel(self.cfg.model, self.generator if generator else None, ctx,
                            seed=self.cfg.train.seed, params_dtype=params_dtype)

    def count(self, batch: Batch) -> list[int]:
        """Masked tokens (the generator's term) and real tokens (the discriminator's)."""
        return [int(batch.target_index.numel()), batch.real_tokens()]

    def sampling_seed(self, batch: Batch) -> int:
        """Seeds the generator's samples of a micro-batch: the run's seed, the epoch and the micro-batch's
        first sample (the same at any TP / DP layout, on resume and in validation)."""
        key = [self.cfg.train.seed, batch.epoch, int(batch.sample_ids[0]), zlib.crc32(b"electra")]
        return int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0] >> 1)

    def loss(self, model, batch: Batch) -> LossOutput:
        out = model(batch.inputs, batch.original, batch.target_index, self.sampling_seed(batch),
                    batch.documents, batch.segments, batch.host_layout)
        generator_sum = vocab_parallel_loss(out.generator_logits, batch.targets, reduction="sum")
        real = batch.documents >= 0
        replaced = (out.corrupted != batch.original) & real
        logits = out.discriminator_logits.float()
        bce = F.binary_cross_entropy_with_logits(logits, replaced.float(), reduction="none")
        discriminator_sum = (bce * real).sum()
        with torch.no_grad():
            predicted = logits > 0
            # [b, s] -> [2, bins]: real tokens per (original | replaced, logit bin); no boolean indexing
            bins = torch.bucketize(logits.clamp(-16, 16), AUC_BINS.to(logits.device)).clamp(1, 128) - 1
            histogram = torch.zeros(2, 128, dtype=torch.float64, device=logits.device)
            histogram.index_put_((replaced.long().flatten(), bins.flatten()), real.flatten().double(),
                                 accumulate=True)
            metrics = {"rtd_correct": ((predicted == replaced) & real).sum(),
                       "replaced": replaced.sum(), "replaced_detected": (predicted & replaced).sum(),
                       "rtd_histogram": histogram}
        loss_sum = torch.stack([generator_sum, self.cfg.objective.rtd_weight * discriminator_sum])
        return LossOutput(loss_sum, self.count(batch), metrics)

    def finish_metrics(self, sums: dict[str, torch.Tensor], counts: list[float]) -> dict[str, float]:
        """Discriminator accuracy over real tokens, replaced share, recall of replaced tokens, AUC."""
        real, replaced = max(counts[1], 1.0), float(sums["replaced"])
        return {"rtd_accuracy": float(sums["rtd_correct"]) / real, "replaced_share": replaced / real,
                "replaced_recall": float(sums["replaced_detected"]) / replaced if replaced else float("nan"),
                "rtd_auc": roc_auc(sums["rtd_histogram"])}

    def summary(self, terms: dict[str, float]) -> dict[str, float]:
        """The generator's MLM perplexity (the validation metric) and the discriminator's mean BCE."""
        return {"ppl": perplexity(terms["generator"]),
                "rtd_bce": terms["discriminator"] / self.cfg.objective.rtd_weight}

    def parameter_count(self) -> int:
        """The discriminator and its head, the generator without an embedding of its own, and its head."""
        model, h = self.cfg.model, self.cfg.model.hidden_size
        return (encoder_parameter_count(model) + (h * h + h) + (h + 1)
                + encoder_parameter_count(self.generator, input_size=model.embedding_dim)
                + mlm_head_parameter_count(model, input_size=self.generator.hidden_size))

    def flops_per_token(self, seq_length: int) -> float:
        """Both models, forward + backward: the discriminator's body and head on every token, the
        generator's projection and body on every token, its MLM head on the masked share."""
        model, gen = self.cfg.model, self.generator
        h, hg = model.hidden_size, gen.hidden_size
        projection = 6 * h * hg if hg != h else 0
        generator_head = 6 * (hg * h + h * model.vocab_size) * self.cfg.data.mask_prob
        return (encoder_flops_per_token(model, seq_length) + 6 * (h * h + h)
                + projection + encoder_flops_per_token(gen, seq_length) + generator_head)

    def log_values(self, model: ElectraModel) -> dict[str, float]:
        return {}

    def exported(self, name: str) -> bool:
        """Exported folders hold the discriminator; the generator only with objective.export_generator."""
        return self.cfg.objective.export_generator or not name.startswith(names.GENERATOR_PREFIX)

    def probe(self, model: ElectraModel, tokens: torch.Tensor) -> torch.Tensor:
        """The discriminator's logits [b, s] on the tokens as they are (ElectraForPreTraining's)."""
        return model.discriminator_head(model.hidden_states(tokens))

    def probe_generator(self, model: ElectraModel, tokens: torch.Tensor) -> torch.Tensor:
        """The generator's logits [b, s, V] at every position of the tokens as they are (ElectraForMaskedLM's,
        but for padding's column: -inf)."""
        b, s = tokens.shape
        logits = model.generator_logits(tokens, torch.arange(b * s, device=tokens.device))
        # [b · s, V_padded] -> [b, s, V]: the vocabulary's padding rows left out
        return logits.view(b, s, -1)[..., :self.cfg.model.vocab_size]

    def architecture_differences(self, source: Config, saved: set[str]) -> list[str]:
        """A folder's generator has its objective.generator_size: the run's must be the same to load it."""
        if not has_generator(saved):
            return []
        ours, theirs = self.cfg.objective.generator_size, source.objective.generator_size
        return [] if ours == theirs else [f"objective.generator_size: run {ours} vs {theirs}"]

    def fresh_head(self, name: str) -> bool:
        """The generator: continued pretraining from a discriminator alone (an exported folder, an imported
        ElectraForPreTraining) starts a new one."""
        return name.startswith(names.GENERATOR_PREFIX)

    def build_pretrained(self, ctx: ParallelContext, saved: set[str]) -> ElectraModel:
        """The discriminator, with the generator when the folder holds one."""
        return self.build_model(ctx, generator=has_generator(saved))
