"""Loss-spike and non-finite-loss detection (the reference's large baseline spiked at ~24k updates
and never recovered; the fix was a restart from an earlier checkpoint with a new seed)."""

from __future__ import annotations

import math
from collections import deque
from statistics import median

from megamlm.errors import MegamlmError


class TrainingDiverged(MegamlmError, RuntimeError):
    """A run that diverged with no rollback left (none saved, or train.max_rollbacks used), or that its
    engine stopped: the CLI says so in one line (exit 2), not as an internal error. (A RuntimeError
    too, as it was before it had a class.)"""


class SpikeGuard:
    """Flags a non-finite loss at once, or `patience` consecutive losses above
    `factor` × the running median of the last `window` accepted losses."""

    def __init__(self, factor: float, patience: int, window: int):
        self.factor, self.patience = factor, patience
        self.history: deque[float] = deque(maxlen=window)
        self.strikes = 0

    def check(self, loss: float) -> str | None:
        """None if the loss is acceptable, else the reason to roll back."""
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if len(self.history) >= self.patience:
            threshold = self.factor * median(self.history)
            if loss > threshold:
                self.strikes += 1
                if self.strikes >= self.patience:
                    return (f"loss above {self.factor} x running median ({threshold / self.factor:.3f}) "
                            f"for {self.strikes} updates (last {loss:.3f})")
                return None
        self.strikes = 0
        self.history.append(loss)
        return None

    def reset(self) -> None:
        self.history.clear()
        self.strikes = 0
