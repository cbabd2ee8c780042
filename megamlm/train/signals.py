"""How a training run is asked to stop: SLURM's signals and Ctrl-C become a flag the loop checks
after each update, so every stop ends with a complete checkpoint."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from megamlm.parallel import ToHost, host_to_device
from megamlm.stop_signals import STOP_SIGNALS


def ignore_stop_signals(worker_id: int) -> None:
    """A data-loader worker's first act: ignore the stop signals, which are the trainer's to handle.
    SLURM (scancel, the time limit, --signal), `timeout`, Kubernetes and a terminal's Ctrl-C signal every
    process of the job, the loader's workers too; a worker killed by one made the trainer fail ("DataLoader
    worker ... is killed by signal") before it could save. The trainer shuts its workers down as it exits."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Preemption:
    """SIGTERM / SIGUSR1 (SLURM's warning before the time limit) and a first Ctrl-C (SIGINT) only
    raise a flag: the loop finishes its update, saves and exits (0 for SIGTERM / SIGUSR1, 130 for
    Ctrl-C). A second Ctrl-C aborts at once; further SIGTERMs while saving change nothing."""

    def __init__(self):
        self.signal: str | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the second one interrupts

    def start_check(self, device) -> ToHost:
        """Whether any rank received a signal (1 or 0), all-reduced and on its way to the host: every rank
        reads the same answer after the same update, without waiting for the device now."""
        # through pinned memory: a copy from pageable memory would wait for every queued kernel
        flag = host_to_device(torch.tensor([float(self.signal is not None)]), device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return ToHost(flag)
