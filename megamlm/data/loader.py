"""The DataLoader around a rank's stream (stream.MaskedBatches): data.loader_workers processes build its
micro-batches, yielded in the stream's order, and a worker's death is one line that says what to do.

A worker that dies (mostly the kernel's out-of-memory killer) is found by the trainer's iterator when its
batches stop coming: torch checks its workers at every 5 s of waiting and raises "DataLoader worker
(pid(s) N) exited unexpectedly". torch's own SIGCHLD handler raised the death in the trainer wherever it
was (a forward, a save) instead, and again at every later SIGCHLD (it checks every worker it knows of):
one that came while the trainer turned the first into its line replaced that line with a bare
RuntimeError, an "internal error" (suite runs of sessions 38 and 48). `start_batches` puts a handler in
its place that keeps torch's words for the death (they name the signal) and raises nothing.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling  # torch's check of its workers, as its own handler calls it

from megamlm.data.batch import Batch
from megamlm.data.stream import MaskedBatches
from megamlm.errors import MegamlmError


def make_loader(stream: MaskedBatches, workers: int = 0, worker_init_fn=None, pin_memory: bool = False) -> DataLoader:
    """A DataLoader that yields the stream's batches in order (batching happens in the stream);
    `worker_init_fn(worker_id)` runs first in each worker process. pin_memory (for a CUDA device): a thread
    of torch's receives the workers' batches and pins them (`Batch.pin_memory`) while the trainer queues
    kernels; without it the trainer's own next() took the handover, 2.8 ms per batch on an H200's host
    (BENCHMARKS.md, session 63)."""
    # its own generator: creating an iterator must not advance the default RNG (dropout, resume)
    return DataLoader(stream, batch_size=None, num_workers=workers, generator=torch.Generator(),
                      persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                      worker_init_fn=functools.partial(_start_worker, worker_init_fn), pin_memory=pin_memory)


def start_batches(stream: MaskedBatches, workers: int = 0, worker_init_fn=None,
                  pin_memory: bool = False) -> Iterator[Batch]:
    """The training loop's iterator over `make_loader`'s batches: its workers started, a death among them
    raised by the iterator alone (the module's docstring), in `loader_deaths_explained`'s words."""
    iterator = iter(make_loader(stream, workers, worker_init_fn, pin_memory))
    if workers:  # torch installed its handler as the first iterator with workers started (once per process)
        with contextlib.suppress(ValueError):  # not the main thread: torch installed none either
            signal.signal(signal.SIGCHLD, _keep_death)
    return iterator


_deaths: list[str] = []
"""torch's words for the workers' deaths since the last `loader_deaths_explained` line, first first."""


def _keep_death(signum, frame) -> None:
    """SIGCHLD while loader workers run: torch's check of every worker it knows of, its error kept, not raised."""
    try:
        signal_handling._error_if_any_worker_fails()
    except RuntimeError as err:
        _deaths.append(str(err))


def _start_worker(worker_init_fn, worker_id: int) -> None:
    sys.excepthook = _quiet_when_the_trainer_hangs_up
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


def _quiet_when_the_trainer_hangs_up(kind, value, tb) -> None:
    """A worker's sys.excepthook. A worker hands each batch's tensors over as file descriptors from a
    background thread (multiprocessing's resource sharer), which prints its errors through sys.excepthook.
    When the trainer stops in the middle of such a handover (a sibling worker died), that thread's
    ConnectionResetError / BrokenPipeError traceback came after the trainer's one-line explanation
    (loader_deaths_explained); the trainer's line says why."""
    if not issubclass(kind, ConnectionError):
        sys.__excepthook__(kind, value, tb)


class LoaderWorkerError(MegamlmError):
    """A data-loader worker process died (data.loader_workers > 0)."""


HANDOVER_DEATH_WAIT_S = 1.0
"""How long a failed handover waits for a worker's death to show (`_death_behind`)."""


def _death_behind(err: Exception) -> str | None:
    """torch's words for the worker death behind `err`, or None where it is not a worker's death.
    torch raises "DataLoader worker ..." itself where its iterator found the worker dead. A batch's tensors come
    over as file descriptors through a socket of the worker's (multiprocessing's resource sharer): a worker
    killed during the handover cut it, and the trainer got a ConnectionResetError or an EOFError while torch's
    check still saw the worker alive (a suite run, session 71). The death shows a moment later: torch's check
    of its workers (as SIGCHLD runs it) until it does, else the error is not a worker's."""
    if isinstance(err, RuntimeError):
        return (_deaths[0] if _deaths else str(err)).strip() if str(err).startswith("DataLoader worker") else None
    deadline = time.monotonic() + HANDOVER_DEATH_WAIT_S
    while not _deaths and time.monotonic() < deadline:
        _keep_death(signal.SIGCHLD, None)
        time.sleep(0.05)
    return _deaths[0].strip() if _deaths else None


@contextlib.contextmanager
def loader_deaths_explained(workers: int):
    """A worker's death as one line that says what to do, in the words torch's check had for it where it ran
    ("DataLoader worker (pid N) is killed by signal: Killed.": `start_batches`): torch's "DataLoader worker
    (pid(s) N) exited unexpectedly", or a batch's handover cut by the death (`_death_behind`)."""
    try:
        yield
    except (RuntimeError, ConnectionError, EOFError) as err:
        said = _death_behind(err) if workers else None
        if said is None:
            raise
        _deaths.clear()
        advice = (f"the kernel's out-of-memory killer: lower data.loader_workers (now {workers}) or give the job "
                  f"more host memory.")
        cause = ""
        if "signal: Killed" in said:
            cause = f" SIGKILL mostly comes from {advice}"
        elif "exited unexpectedly" in said:
            cause = f" A worker that exits without a Python error was most likely killed, mostly by {advice}"
        raise LoaderWorkerError(f"a data loader worker died: {said}{cause} Continue from the last checkpoint "
                                f"with --resume auto") from err
