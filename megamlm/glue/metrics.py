"""GLUE metrics: the reference's numbers (accuracy; STS-B validation MSE on the [0, 1] scale) and
GLUE's standard ones (Matthews correlation, F1 of the positive class, Pearson / Spearman)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def compute_metrics(names: tuple[str, ...], predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """predictions: class ids, or scores for regression; labels alike."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef

    predictions, labels = np.asarray(predictions), np.asarray(labels)
    out = {}
    for name in names:
        if name == "accuracy":
            out[name] = float((predictions == labels).mean())
        elif name == "f1":
            out[name] = float(f1_score(labels, predictions))
        elif name == "mcc":
            out[name] = float(matthews_corrcoef(labels, predictions))
        elif name == "mse":
            out[name] = float(((predictions - labels) ** 2).mean())
        elif name == "pearson":
            out[name] = float(pearsonr(predictions, labels)[0]) if predictions.std() > 0 else 0.0
        elif name == "spearman":
            out[name] = float(spearmanr(predictions, labels)[0]) if predictions.std() > 0 else 0.0
        else:
            raise ValueError(f"unknown metric {name}")
    return out


HIGHER_IS_BETTER = {"accuracy": True, "f1": True, "mcc": True, "pearson": True, "spearman": True, "mse": False}


def best_of(metric: str, candidates: Iterable[T], scores: Callable[[T], dict[str, float]]) -> T:
    """The first candidate whose `metric` (in `scores(candidate)`) is best: an epoch, a seed."""
    sign = 1 if HIGHER_IS_BETTER[metric] else -1
    return max(candidates, key=lambda candidate: sign * scores(candidate)[metric])
