"""The probe-batch parity check every conversion ends with: the written result and an
independent computation of the source give the same logits at every real position over the whole
vocabulary, or nothing is written."""

from __future__ import annotations

import torch

from megamlm.config import Config, ParallelConfig, replace_config
from megamlm.convert.fairseq import ConversionError
from megamlm.model import names
from megamlm.model.reshard import load_full_state_dict
from megamlm.objectives import get_objective
from megamlm.objectives.classification import CLASSIFIER_HEADS, Pooling
from megamlm.objectives.pretrained import encoder_of
from megamlm.parallel import init_distributed


def probe_tokens(cfg: Config, seed: int = 0) -> torch.Tensor:
    """[2, s] fairseq ids: <s> ... </s>, a mask token, the second row right-padded; longer than a
    local layer's window (so that the window is exercised)."""
    model = cfg.model
    length = min(24, model.max_positions) if model.position == "learned" else max(24, (model.local_window or 0) + 8)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, model.vocab_size, (2, length), generator=g)
    tokens[:, 0], tokens[:, -1] = 0, 2
    tokens[0, length // 2] = model.vocab_size if model.zero_mask else model.vocab_size - 1
    tokens[1, length - 6:] = model.pad_token_id
    tokens[1, length - 7] = 2
    if model.token_types:  # a second segment, so that token type 1 is checked too
        tokens[0, length // 3] = model.separator_token_id
    return tokens


def compare(ours: torch.Tensor, theirs: torch.Tensor, tokens: torch.Tensor, pad: int, what: str,
            tolerance: float, per_sequence: bool = False) -> float:
    """Max |logit difference| over real positions (`per_sequence` logits [b, labels]: over every row); raises
    when above tolerance × max(1, |logit|)."""
    real = torch.ones(len(tokens), dtype=torch.bool) if per_sequence else tokens.ne(pad)
    diff = (ours.float() - theirs.float())[real].abs().max().item()
    scale = max(1.0, theirs.float()[real].abs().max().item())
    if not diff <= tolerance * scale:
        raise ConversionError(f"logits differ from {what}: max |Δ| = {diff:.3g} > {tolerance:g} × {scale:.3g}; "
                                 f"nothing was written")
    return diff


def megamlm_logits(cfg: Config, full: dict[str, torch.Tensor], tokens: torch.Tensor,
                   generator: bool = False) -> torch.Tensor:
    """The objective's probe output (masked LM: logits [b, s, V]) of the model `full` holds; `generator`:
    ELECTRA's generator's logits [b, s, V] instead, padding's column left out (megamlm's is -inf)."""
    ctx = init_distributed(ParallelConfig())
    objective = get_objective(replace_config(cfg, ["parallel.tensor_parallel=1"]))  # a world of one runs it
    model = objective.build_pretrained(ctx, set(full))
    load_full_state_dict(model, full)
    with torch.no_grad():
        if not generator:
            return objective.probe(model.eval(), tokens)
        return without_padding_column(objective.probe_generator(model.eval(), tokens), cfg.model.pad_token_id)


def without_padding_column(logits: torch.Tensor, pad: int) -> torch.Tensor:
    """[..., V] -> [..., V - 1]: the logits of every symbol but padding."""
    return torch.cat([logits[..., :pad], logits[..., pad + 1:]], dim=-1)


def encoder_states(cfg: Config, full: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """[b, s, h]: the encoder's output for a folder without any head (a bare encoder read from transformers'
    *Model class), as that class's last_hidden_state."""
    encoder = encoder_of(replace_config(cfg, ["parallel.tensor_parallel=1"]).model, full,
                         init_distributed(ParallelConfig()))
    with torch.no_grad():
        # [s, b, h] -> [b, s, h]
        return encoder(tokens, host_layout=(tokens, None, None)).transpose(0, 1)


def classifier_logits(cfg: Config, full: dict[str, torch.Tensor], heads: dict[str, torch.Tensor], name: str,
                      tokens: torch.Tensor) -> torch.Tensor:
    """[b, labels]: the folder's classification head `name` (model.classifier, on model.classifier_pooling's
    features) on each probe row, as `megamlm glue` computes it."""
    model = replace_config(cfg, ["parallel.tensor_parallel=1"]).model
    if f"{name}.out_proj.weight" not in heads:
        raise ConversionError(f"no classification head {name!r} in the folder (it has: "
                              f"{', '.join(sorted({key.split('.')[0] for key in heads})) or 'none'})")
    encoder = encoder_of(model, full, init_distributed(ParallelConfig()))
    head = CLASSIFIER_HEADS[model.classifier](model, heads[f"{name}.out_proj.weight"].shape[0])
    head.restore(name, {names.CLASSIFICATION_HEADS + key: value for key, value in heads.items()})
    b, s = tokens.shape
    pooling = Pooling.of(torch.arange(b) * s, tokens.ne(model.pad_token_id).sum(1).tolist(), b * s,
                         model.classifier_pooling)
    with torch.no_grad():
        hidden = encoder(tokens, host_layout=(tokens, None, None))  # [s, b, h]
        return head.eval()(pooling(hidden))  # [b, h] -> [b, labels]
