"""ELECTRA's generator from transformers: `megamlm convert --from hf DISCRIMINATOR OUT --generator GENERATOR`.

The Hub keeps a pretrained ELECTRA as two folders: the discriminator (`ElectraForPreTraining`, what the
importer reads) and the generator (`ElectraForMaskedLM`, e.g. google/electra-base-generator). ELECTRA trains
them with one embedding module (token, position and token-type tables and their LayerNorm), so the
generator folder's `electra.embeddings.*` are copies of the discriminator's; megamlm's generator reads the
discriminator's embedding itself (objectives/electra.py). Reading the generator along makes continued
pretraining start from both models instead of a new generator.

megamlm's generator is the discriminator's shape scaled by objective.generator_size: the same depth, head
size, embedding and vocabulary, heads / hidden / FFN in one ratio. A generator folder that is not that shape,
or whose embeddings are not the discriminator's, computes another function and is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megamlm.config import ModelConfig
from megamlm.convert.fairseq import ConversionError
from megamlm.convert.hf import hf_to_megamlm
from megamlm.convert.hf_formats import ELECTRA_GENERATOR
from megamlm.model import names
from megamlm.objectives.electra import generator_config

SHARED = ("vocab_size", "embedding_size", "max_position_embeddings", "type_vocab_size", "num_hidden_layers",
          "layer_norm_eps", "position_embedding_type")
"""config.json values the generator has as the discriminator does (its embedding is the discriminator's)."""
HEAD_ACTIVATION = "gelu"
"""transformers' ElectraGeneratorPredictions applies GELU whatever hidden_act says; megamlm's generator
head applies model.activation: the two agree for this hidden_act (every released ELECTRA's)."""


def generator_size(values: dict, discriminator: dict) -> float:
    """objective.generator_size of a generator's config.json `values`: its heads over the discriminator's."""
    return values["num_attention_heads"] / discriminator["num_attention_heads"]


def check_generator_config(path: Path, values: dict, discriminator: dict, model: ModelConfig) -> ModelConfig:
    """The generator's model section, from its config.json (`path`, `values`), checked against the
    discriminator's config.json values and model section: the shared settings and the shape megamlm builds."""
    differ = [f"{key}={values.get(key)!r} (the discriminator's: {discriminator.get(key)!r})" for key in SHARED
              if values.get(key) != discriminator.get(key)]
    if values.get("hidden_act", "gelu") != HEAD_ACTIVATION:
        differ.append(f"hidden_act={values.get('hidden_act')!r} (transformers' generator head applies "
                      f"{HEAD_ACTIVATION!r}, megamlm's hidden_act)")
    if differ:
        raise ConversionError(f"{path}: {'; '.join(differ)}: megamlm's generator shares the discriminator's "
                              f"embedding and settings")
    size = generator_size(values, discriminator)
    want = generator_config(model, min(size, 1.0))
    keys = ("hidden_size", "num_attention_heads", "intermediate_size")
    got, built = (tuple(values[k] for k in keys),
                  (want.hidden_size, want.num_attention_heads, want.ffn_hidden_size))
    if size > 1.0 or got != built:
        def shape(numbers):
            return ", ".join(f"{k}={v}" for k, v in zip(keys, numbers))
        raise ConversionError(
            f"{path}: {shape(got)}: megamlm's generator is the discriminator ({shape(discriminator[k] for k in keys)}) "
            f"scaled by objective.generator_size, with the same head size; {got[1]} heads give {shape(built)}")
    return want


def generator_weights(generator: ModelConfig, weights: Path, state: dict[str, torch.Tensor],
                      discriminator: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The generator's tensors as megamlm's `generator.*` (HF vocabulary order), from its state dict `state`
    (read from `weights`; `generator`: check_generator_config's), checked: its embeddings are the
    discriminator's (HF state dict `discriminator`) and its decoder is tied to them."""
    for key, value in state.items():
        if key.startswith(f"{ELECTRA_GENERATOR.prefix}.embeddings.") and key in discriminator \
                and not torch.equal(value.float(), discriminator[key].float()):
            raise ConversionError(f"{weights}: {key} differs from the discriminator's: ELECTRA trains one "
                                  f"embedding for both models and megamlm's generator reads the discriminator's")
    decoder = state.get(ELECTRA_GENERATOR.decoder.format(kind="weight"))
    embeddings = discriminator[ELECTRA_GENERATOR.word_embeddings]
    if decoder is not None and not torch.equal(decoder.float(), embeddings.float()):
        raise ConversionError(f"{weights}: {ELECTRA_GENERATOR.decoder.format(kind='weight')} differs from the word "
                              f"embeddings (an untied decoder): megamlm's generator ties them")
    own = hf_to_megamlm({k: v.float() for k, v in state.items()}, generator, ELECTRA_GENERATOR)
    shared = {key for key in own if key.startswith("embedding.")}  # the discriminator's (checked above)
    return {names.GENERATOR_PREFIX + key: value for key, value in own.items() if key not in shared}
