"""`megamlm train --nproc N`: torchrun in this process, ending as a run of one process would.

Each rank that fails prints its one line and, under torchrun, records it with its exit code in the error
file torchrun names (TORCHELASTIC_ERROR_FILE: torchrun reads it back for every failed rank, even one it
stopped with SIGTERM while that rank was still exiting). The launching process picks the rank that failed
first on its own from those records (`first_failure`), says which in one more line, and exits with that
rank's code: 2 for a user's mistake, 1 for a bug, not PEER_GONE_EXIT (a rank whose collective lost the one
that failed), not torchrun's SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from megamlm.config import Config
from megamlm.console import print_line
from megamlm.errors import MegamlmError, check_ranges
from megamlm.stop_signals import STOP_SIGNALS

PEER_GONE_EXIT = 3
"""A rank's exit code when a collective failed because another rank's process ended (errors.peer_gone)."""

RECORD_KEY = "megamlm"
"""Where a rank's error file holds {"exit": code, "time": seconds since the epoch (float)}."""


def failed(line: str, code: int) -> int:
    """Print a failure's one line and return its exit code; under torchrun, also record both for the
    process that launched the ranks."""
    print_line(line, sys.stderr)
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        now = time.time()
        with contextlib.suppress(OSError):  # the line is printed; the record only orders the ranks' lines
            with open(path, "w") as out:  # torchrun's reader takes "message" and an integer "timestamp"
                json.dump({"message": line, "timestamp": int(now), RECORD_KEY: {"exit": code, "time": now}}, out)
    return code


def recorded(failure) -> tuple[int, float]:
    """(exit code, time) of a torchrun ProcessFailure: the rank's own record, else what torchrun saw."""
    record = failure.error_file_data.get(RECORD_KEY)
    return (record["exit"], record["time"]) if record else (failure.exitcode, failure.timestamp)


def first_failure(failures: dict) -> tuple[int, int]:
    """(rank, exit code) of the rank that failed first on its own, of torchrun's {rank: ProcessFailure}:
    torchrun stops the others with SIGTERM, and a rank whose collective lost that one exits PEER_GONE_EXIT;
    within the same time, the lower rank."""
    def order(item):
        code, when = recorded(item[1])
        return code < 0, code == PEER_GONE_EXIT, when, item[0]

    rank, failure = min(failures.items(), key=order)
    return rank, recorded(failure)[0]


INTERRUPTED_EXIT = 130
"""A rank's exit code after Ctrl-C (saved, or aborted by a second one): the run's, without a line of ours."""


def children() -> list[int]:
    """The processes this one started (torchrun's ranks), from /proc."""
    me, pids = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # a process that ended meanwhile
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:  # "pid (name) state ppid ..."
                pids.append(int(stat.parent.name))
    return pids


class StopForwarding:
    """While the ranks run: a stop signal (SIGTERM, SIGUSR1, Ctrl-C) to this process goes on to every rank,
    which finishes its update, saves and exits as a run of one process does; this process waits for them
    however long the save takes, and ends with their code. torchrun's own handling sent SIGTERM and
    SIGINT on too, but then killed the ranks 30 s later (TORCH_ELASTIC_SHUTDOWN_TIMEOUT: a save of a large
    model on shared storage takes longer) and ended with 128 + the signal; SIGUSR1 killed this process and
    left the ranks without it. A second Ctrl-C goes on as well: the ranks stop at once. Before any rank
    started, a stop signal ends the launch. Without /proc (not Linux) torchrun keeps its handling."""

    TORCHRUN_KEEPS = "SIGHUP,SIGQUIT"
    """torchrun's default signals to handle, less the stop signals."""

    def __init__(self):
        self.active = Path("/proc/self/stat").exists()
        self.received: int | None = None

    def _forward(self, signum, frame):
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.received = self.received or signum
        ranks = children()
        if not ranks:  # none started yet (the machines still meet): the launch ends, as under torchrun
            raise SignalException(f"{signal.Signals(signum).name} before the ranks started", signum)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def __enter__(self):
        self.previous = {sig: signal.signal(sig, self._forward) for sig in STOP_SIGNALS} if self.active else {}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def torchrun_arguments(self) -> list[str]:
        return [f"--signals-to-handle={self.TORCHRUN_KEEPS}"] if self.active else []


LAUNCH_OPTIONS = ("--nproc", "--nodes", "--rendezvous", "--rendezvous-id")
"""`megamlm train`'s options for this process, which the ranks' command line does not repeat."""


def launch_problem(args) -> str | None:
    """What is wrong with --nproc, --nodes and --rendezvous, in a line, or None."""
    try:
        check_ranges([(f"--nproc {args.nproc}", args.nproc, ">= 1"), (f"--nodes {args.nodes}", args.nodes, ">= 1")])
    except MegamlmError as err:
        return str(err)
    if args.nodes > 1 and args.rendezvous is None:
        return f"--nodes {args.nodes} needs --rendezvous HOST:PORT (where the machines meet)"
    if args.rendezvous is not None:
        host, _, port = args.rendezvous.rpartition(":")
        if not host or not port.isdigit():
            return f"--rendezvous {args.rendezvous}: expected HOST:PORT"
    return None


def launches_ranks(args) -> bool:
    """Whether this process starts the ranks (--nproc or --nodes > 1), or is one: started by a launcher
    (torchrun's LOCAL_RANK, in a world of --nproc x --nodes). A launcher's variables left in the environment
    would make each machine a run of its own (two runs writing one run dir): refused."""
    processes = args.nproc * args.nodes
    if "LOCAL_RANK" not in os.environ:
        return processes > 1
    if processes > 1 and os.environ.get("WORLD_SIZE") != str(processes):
        raise MegamlmError(f"--nproc {args.nproc} --nodes {args.nodes} asks for {processes} processes, but this "
                          f"process has a launcher's LOCAL_RANK={os.environ['LOCAL_RANK']} and WORLD_SIZE="
                          f"{os.environ.get('WORLD_SIZE', '(unset)')}; unset the launcher's variables (RANK, "
                          f"WORLD_SIZE, LOCAL_RANK) or leave out --nproc and --nodes under a launcher")
    return False


def ranks_argv(argv: list[str]) -> list[str]:
    """The ranks' command line: this one less LAUNCH_OPTIONS (as "--option value" or "--option=value")."""
    kept = []
    for i, arg in enumerate(argv):
        if arg.split("=", 1)[0] not in LAUNCH_OPTIONS and not (i and argv[i - 1] in LAUNCH_OPTIONS):
            kept.append(arg)
    return kept


def torchrun_layout(args) -> list[str]:
    """torchrun's options for --nproc on this machine and, with --rendezvous, the run's --nodes."""
    layout = [f"--nproc-per-node={args.nproc}"]
    if args.rendezvous is None:
        return ["--standalone", *layout]
    return [f"--nnodes={args.nodes}", *layout, "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rendezvous}",
            f"--rdzv-id={args.rendezvous_id}"]


def relaunch_with_torchrun(cfg: Config, args, argv: list[str]) -> int:
    """`megamlm train --nproc N ...` = `torchrun --standalone --nproc-per-node N -m megamlm train ...` (with
    --nodes and --rendezvous: torchrun's c10d rendezvous), in this process, once what every rank would
    refuse first is checked here (one line, no ranks started). Ranks that fail have printed their own
    line; one more says which failed first, in place of torchrun's traceback and log lines. Returns the
    exit code a run of one process gives: the first failed rank's (130 after Ctrl-C, 0 after SIGTERM or
    SIGUSR1: see StopForwarding), or 128 + a signal torchrun handled."""
    for path in args.config:  # read here once: a pipe (a shell's `<(...)`) would be empty for the ranks
        if not Path(path).is_file():
            raise MegamlmError(f"--config {path} is not a file (a shell's <(...)?): each of the ranks reads the "
                               f"config again; write it to a file")
    from torch.distributed.elastic.multiprocessing import errors
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import parse_args, run

    from megamlm.train.preflight import check_before_launch

    check_before_launch(cfg, args.nproc, args.nodes, args.resume, args.overwrite, args.allow_batch_change)
    # torchrun's own lines (its OMP_NUM_THREADS banner: it sets 1 a rank; "closing signal"; "failed
    # (exitcode ...)") say again what the ranks' lines and the one below say; this process logs nothing else
    logging.disable(logging.ERROR)
    try:
        with StopForwarding() as stops:
            run(parse_args([*torchrun_layout(args), *stops.torchrun_arguments(), "-m", "megamlm", *ranks_argv(argv)]))
    except errors.ChildFailedError as err:
        rank, code = first_failure(err.failures)
        if stops.received and code == INTERRUPTED_EXIT:  # Ctrl-C: each rank said what it saved
            return code
        how = f"signal {err.failures[rank].signal_name()}" if code < 0 else f"exit code {code}"
        here = " on this machine" if args.nodes > 1 else ""
        print_line(f"megamlm: train: {len(err.failures)} of {args.nproc} ranks{here} failed, rank {rank} first "
                   f"({how}); what each said is above", sys.stderr)
        return code if code > 0 else 1
    except SignalException as err:  # before the ranks started, one torchrun kept (SIGHUP, SIGQUIT), or no /proc
        print_line(f"megamlm: train: stopped: {err}", sys.stderr)
        return 128 + err.sigval
    finally:
        logging.disable(logging.NOTSET)
    return 0
