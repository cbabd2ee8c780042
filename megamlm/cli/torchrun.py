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
import sys
import time

from megamlm.config import Config

PEER_GONE_EXIT = 3
"""A rank's exit code when a collective failed because another rank's process ended (errors.peer_gone)."""

RECORD_KEY = "megamlm"
"""Where a rank's error file holds {"exit": code, "time": seconds since the epoch (float)}."""


def failed(line: str, code: int) -> int:
    """Print a failure's one line and return its exit code; under torchrun, also record both for the
    process that launched the ranks."""
    print(line, file=sys.stderr)
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


def relaunch_with_torchrun(cfg: Config, args, argv: list[str]) -> int:
    """`megamlm train --nproc N ...` = `torchrun --standalone --nproc-per-node N -m megamlm train ...`, in this
    process, once what every rank would refuse first is checked here (one line, no ranks started). Ranks
    that fail have printed their own line; one more says which failed first, in place of torchrun's
    traceback and log lines. Returns the exit code a run of one process gives: the first failed rank's, or
    128 + the signal that stopped the run (130 for Ctrl-C)."""
    from torch.distributed.elastic.multiprocessing import errors
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import parse_args, run

    from megamlm.train.preflight import check_before_launch

    check_before_launch(cfg, args.nproc, args.resume, args.overwrite)
    argv = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")
            and not a.startswith("--nproc=")]
    # torchrun's own lines (its OMP_NUM_THREADS banner: it sets 1 a rank; "closing signal"; "failed
    # (exitcode ...)") say again what the ranks' lines and the one below say; this process logs nothing else
    logging.disable(logging.ERROR)
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={args.nproc}", "-m", "megamlm", *argv]))
    except errors.ChildFailedError as err:
        rank, code = first_failure(err.failures)
        how = f"signal {err.failures[rank].signal_name()}" if code < 0 else f"exit code {code}"
        print(f"megamlm: train: {len(err.failures)} of {args.nproc} ranks failed, rank {rank} first ({how}); "
              f"what each said is above", file=sys.stderr)
        return code if code > 0 else 1
    except SignalException as err:  # Ctrl-C, SIGTERM: torchrun passed it on, the ranks saved and said so
        return 128 + err.sigval
    finally:
        logging.disable(logging.NOTSET)
    return 0
