"""Fill-mask: the top-k completions of the first `<mask>` in a sentence (fairseq hub semantics); a
vocabulary's own name for it (BERT's `[MASK]`) works too."""

from __future__ import annotations

import torch

from megamlm.data.tokenizer import BOS, EOS, Tokenizer
from megamlm.errors import MegamlmError

MASK_TEXT = "<mask>"


def mask_marker(text: str, tokenizer: Tokenizer) -> str:
    """What stands for the mask in `text`: `<mask>`, or the vocabulary's own name for it (BERT's [MASK])."""
    markers = dict.fromkeys([MASK_TEXT, getattr(tokenizer, "mask_text", MASK_TEXT)])
    found = next((marker for marker in markers if marker in text), None)
    if found is None:
        raise MegamlmError(f"the text has no {' or '.join(markers)}: {text!r}")
    return found


def encode_masked(text: str, tokenizer: Tokenizer) -> torch.Tensor:
    """`<s> ... <mask> ... </s>` ids [1, s]; as fairseq, each span before a mask drops its trailing
    whitespace, so the mask stands for a token with its leading space (" Beijing")."""
    spans = text.split(mask_marker(text, tokenizer))
    ids = [BOS]
    for i, span in enumerate(spans):
        ids += tokenizer.encode(span.rstrip() if i < len(spans) - 1 else span).tolist()
        if i < len(spans) - 1:
            ids.append(tokenizer.dictionary.mask_id)
    return torch.tensor([ids + [EOS]])


@torch.no_grad()
def fill_mask(model, tokenizer: Tokenizer, text: str, topk: int = 5) -> list[tuple[str, float, str]]:
    """[(filled sentence, probability, token)] for the first mask, most probable first."""
    if not hasattr(model, "gather_logits"):
        raise MegamlmError(f"fill-mask needs a masked-LM head; this model ({type(model).__name__}) has none "
                           f"(ELECTRA: fill-mask scores the generator, exported only with objective.export_generator)")
    tokens = encode_masked(text, tokenizer).to(model.ctx.device)
    masked = tokens.eq(tokenizer.dictionary.mask_id)
    first = masked.nonzero()[0]
    only_first = torch.zeros_like(masked)
    only_first[first[0], first[1]] = True
    logits = model.gather_logits(model(tokens, only_first))[0]
    probs = logits.float().softmax(-1)
    values, ids = probs.topk(topk)
    results = []
    for p, i in zip(values.tolist(), ids.tolist()):
        word = tokenizer.decode([i])
        before, _, after = text.partition(mask_marker(text, tokenizer))
        filled = (before.rstrip() + word if word.startswith(" ") else before + word) + after
        results.append((filled, p, word))
    return results
