"""The signals that ask a megamlm process to stop, and what they do before its work can take them.

SLURM (scancel, a time limit's --signal, preemption), `timeout`, Kubernetes and a terminal send
SIGTERM, SIGUSR1 or SIGINT. A training turns them into a flag it reads after each update (finish the
update, save, exit: `megamlm.train.signals`), and `megamlm train --nproc` passes them on to its ranks
(`megamlm.cli.torchrun`). Before either takes over (Python's imports, a training's setup: a large
checkpoint's load, compilation, a SLURM job's first seconds) SIGTERM and SIGUSR1 killed the process
without a word (exit 143 / 138: a job log said only "Terminated"), while SIGINT raised KeyboardInterrupt.
`raising_on_stop_signals` makes the two raise `Stopped` the same way, which the command line reports as one
line with exit 128 + the signal, after every `finally` on the way has run (nothing half-written stays).
`holding_stop_signals` defers them over a step that must not end halfway, `starting_workers` over a
pool starting a worker (the shard build's, GLUE's --parallel). Torch-free: the command line installs it
before any heavy import."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""Every signal that asks a run to stop: the training saves on any of them."""


class Stopped(BaseException):
    """A stop signal before the work took it. A BaseException, as KeyboardInterrupt is: an `except
    Exception` on the way (a retry, a fallback) must not swallow it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def raising_on_stop_signals():
    """Within: SIGTERM and SIGUSR1 raise `Stopped` in this process's main thread (SIGINT keeps Python's
    KeyboardInterrupt), until the work installs its own handling; the previous handlers come back at the
    end. A process forked meanwhile dies of them as it did, without a line: the process that forked it
    reports. Outside the main thread (where Python cannot set handlers) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def _raise(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, _raise) for sig in STOP_SIGNALS if sig != signal.SIGINT}
    try:
        yield
    finally:
        _put_back(previous)


@contextlib.contextmanager
def holding_stop_signals():
    """Within: a stop signal (any of STOP_SIGNALS) is held, and raised again at the end to whatever handles
    it there: for a step that must not end halfway (a worker's start written into its pipe). Blocking it
    (pthread_sigmask) would not do: the kernel hands a process's signal to another thread then (a reader's,
    tqdm's), and Python runs the handler in the main thread all the same, between any two bytecodes. Main
    thread only (elsewhere it changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    released = False

    def _hold(signum, frame):
        if not released:
            held.append(signum)
            return
        signal.signal(signum, previous[signum])  # one that comes while the handlers are put back: as after
        signal.raise_signal(signum)

    previous = {sig: signal.signal(sig, _hold) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        released = True
        _put_back(previous)
        for signum in dict.fromkeys(held):  # each once, in the order they came
            signal.raise_signal(signum)


@contextlib.contextmanager
def starting_workers():
    """Over a pool's submit, which may start a worker process: the stop signals held (`holding_stop_signals`:
    a worker's start is not cut halfway) and SIGINT blocked, so that the worker starts with it blocked (a
    process inherits the mask): a terminal's Ctrl-C, sent to the whole group, is this process's alone to act
    on, where each worker printed its KeyboardInterrupt."""
    with holding_stop_signals():
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _put_back(previous: dict) -> None:
    """The handlers `signal.signal` returned, set again."""
    for sig, handler in previous.items():
        if handler is not None:  # None: not set from Python (cannot be put back from here)
            signal.signal(sig, handler)
