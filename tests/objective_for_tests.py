"""A second objective, used only by the tests: it proves that an objective is one module + one
registry entry (README, "Extending megamlm"), with no edit to the loop, validation or folders.

`reconstruct-all`: masks 30% of the tokens (MLM's 80/10/10 rule) but predicts every real token,
masked or not, and reports the share it gets right.
"""

import numpy as np

from megamlm.data.batch import Batch
from megamlm.data.masking import Masker
from megamlm.model.encoder import encoder_flops_per_token
from megamlm.objectives import LossOutput, register_objective
from megamlm.objectives.mlm import MaskedLanguageModeling, mlm_head_flops_per_token


class MaskThirtyTargetAll:
    """Corruption: the inputs of a 30% Masker, every position a target."""

    def __init__(self, masker: Masker):
        self.masker = masker

    def __call__(self, tokens: np.ndarray, epoch: int, index: int):
        inputs, _ = self.masker(tokens, epoch, index)
        return inputs, np.ones(len(tokens), dtype=bool)


@register_objective
class ReconstructAll(MaskedLanguageModeling):
    name = "reconstruct-all"

    def corruption(self, tokenizer, seed):
        dictionary = tokenizer.dictionary
        return MaskThirtyTargetAll(Masker(dictionary.mask_id, dictionary.ordinary_ids(), 0.3, seed=seed))

    def loss(self, model, batch: Batch) -> LossOutput:
        logits = model(batch.inputs, batch.target_index, batch.documents)
        module = getattr(model, "module", model)
        correct = (module.gather_logits(logits.detach()).argmax(-1) == batch.targets).sum()
        return LossOutput(module.loss(logits, batch.targets, reduction="sum").reshape(1), self.count(batch),
                          {"accuracy": correct})

    def flops_per_token(self, seq_length: int) -> float:
        model = self.cfg.model
        return encoder_flops_per_token(model, seq_length) + mlm_head_flops_per_token(model, 1.0)
