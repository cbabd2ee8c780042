"""The recipes' optimizers (glue/recipes.py: `Recipe.bias_correction`): torch's AdamW, or TF BERT/ELECTRA's
Adam without bias correction. Apart from the recipe table so that the table (the CLI's --recipe choices)
imports without torch."""

from __future__ import annotations

import torch

from megamlm.glue.recipes import Recipe


class AdamWeightDecay(torch.optim.Optimizer):
    """TF BERT/ELECTRA's AdamWeightDecayOptimizer: Adam without bias correction, decoupled weight decay:

        m = β1·m + (1 − β1)·g;   v = β2·v + (1 − β2)·g²;   p −= lr · (m / (√v + ε) + wd · p)
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), params = group["betas"], [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
            grads = [p.grad for p in params]
            m, v = [s["m"] for s in states], [s["v"] for s in states]
            torch._foreach_mul_(m, beta1)
            torch._foreach_add_(m, grads, alpha=1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
            update = torch._foreach_div(m, torch._foreach_add(torch._foreach_sqrt(v), group["eps"]))
            if group["weight_decay"]:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, update, alpha=-group["lr"])


def build_optimizer(groups: list[dict], recipe: Recipe) -> torch.optim.Optimizer:
    """The recipe's optimizer over param groups that carry their own "weight_decay" (and "lr_scale")."""
    if recipe.bias_correction:
        return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas, eps=recipe.eps, fused=True)
    return AdamWeightDecay(groups, lr=recipe.lr, betas=recipe.betas, eps=recipe.eps, weight_decay=0.0)
