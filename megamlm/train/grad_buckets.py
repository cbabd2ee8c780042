"""When each bucket of the flat engine's gradients may start its reduction over DP
(train.overlap_grad_reduce; train/flat.py cuts the buffers into buckets and reduces one).

A hook on every parameter (autograd's post-accumulate hook) counts, during the update's last backward,
the parameters each bucket still waits for. Buckets start in one fixed order on every rank, since
collectives must match across ranks: by the first parameter each holds, last first, the order the
backward finishes them in. A bucket that is complete out of that order waits for the ones before it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch.distributed as dist
from torch import nn


class BucketLaunches:
    """Starts `reduce(bucket)` (an asynchronous collective) for each bucket of `buckets` ([lo, hi) of
    the flat buffers; `offsets`: id(parameter) -> its first element) once the backward has finished it."""

    def __init__(self, params: list[nn.Parameter], offsets: dict[int, int], buckets: list[tuple[int, int]],
                 reduce: Callable[[int], dist.Work]):
        holds = {id(p): [b for b, (lo, hi) in enumerate(buckets) if lo < offsets[id(p)] + p.numel() and
                         offsets[id(p)] < hi] for p in params}
        self.sizes = [sum(b in holds[id(p)] for p in params) for b in range(len(buckets))]
        first_param = [min((i for i, p in enumerate(params) if b in holds[id(p)]), default=len(params))
                       for b in range(len(buckets))]
        self.order = sorted(range(len(buckets)), key=lambda b: (-first_param[b], b))
        self.reduce = reduce
        self.active = False
        """In the update's last backward: `start` arms it, `wait` disarms it."""
        self.waiting = list(self.sizes)  # per bucket: parameters the backward has yet to finish
        self.launched = 0  # buckets of `order` whose collective is in flight
        self.in_flight: list[dist.Work] = []
        for p in params:
            p.register_post_accumulate_grad_hook(partial(self._accumulated, holds[id(p)]))

    def start(self) -> None:
        """The next backward is the update's last."""
        self.active = True

    def _accumulated(self, buckets: list[int], _param: nn.Parameter) -> None:
        """A parameter's gradient is complete: one parameter fewer for each bucket it lies in."""
        if self.active:
            for b in buckets:
                self.waiting[b] -= 1
            self.launch_ready()

    def launch_ready(self, every: bool = False) -> None:
        """Start the buckets that are complete, in `order` (every: all that are left, those the backward
        reached no parameter of included)."""
        while self.launched < len(self.order) and (every or not self.waiting[self.order[self.launched]]):
            self.in_flight.append(self.reduce(self.order[self.launched]))
            self.launched += 1

    def wait(self) -> None:
        """Wait for every bucket's collective; the next update counts anew."""
        for work in self.in_flight:
            work.wait()
        self.in_flight, self.launched, self.active, self.waiting = [], 0, False, list(self.sizes)
