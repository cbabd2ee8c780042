"""Run a function on N real processes joined by a gloo group, from inside one pytest test; run Python
command lines (`python -m megamlm train ...`) as such processes too (`run_commands`).

Each rank is a new process (torch and gloo state start clean), forked from a server process that
imported torch, megatron-core, DeepSpeed and megamlm once for the whole session: a spawned rank
spent ~5 s importing them, in every multi-rank run of the suite. Each rank gets the
test's current environment plus torchrun's variables, runs `fn(*args)` and returns its result
through a file. A failure on any rank re-raises in the test with that rank's traceback.
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# imported once by the fork server (a module that fails to import is left to the rank to import); megamlm
# before megatron.core, which it then imports as a user's process does (megamlm/megatron_import.py)
PRELOAD = ["torch", "megamlm", "megatron.core", "deepspeed", "transformers", "megamlm.train.loop", "megamlm.glue"]
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(PRELOAD)


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def shell_environment(**extra: str) -> dict[str, str]:
    """This process's environment less the launcher variables `init_distributed` set in it, plus `extra`:
    what a command a test starts would see in a user's shell (`megamlm train --nproc 2` reads a
    LOCAL_RANK as torchrun's and does not launch the ranks)."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}, **extra}


def _as_a_new_process(environ: dict) -> None:
    """A child of the fork server made to look like a freshly started one."""
    # the server's environment is the one of its start: the test's own is what a spawned process saw
    os.environ.clear()
    os.environ.update(environ)
    # a fork server's child inherits "forkserver" as its default start method; a new process has none
    # set, so its data-loader workers fork (and do not import torch again in a new server)
    mp.set_start_method(None, force=True)


def _worker(rank: int, world_size: int, port: int, out_dir: str, environ: dict, fn, args) -> None:
    _as_a_new_process(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        result = fn(*args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        from megamlm.parallel import destroy_distributed

        destroy_distributed()


def run_on_ranks(fn, world_size: int = 2, *args, timeout: float = 600):
    """Results of `fn(*args)` on ranks 0..world_size-1 (fn must be importable, i.e. top level)."""
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [CONTEXT.Process(target=_worker, args=(r, world_size, port, out_dir, dict(os.environ), fn, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                raise TimeoutError(f"rank process {p.pid} did not finish in {timeout}s")
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} died without a result (exit code {procs[rank].exitcode})")
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                raise RuntimeError(f"rank {rank} failed:\n{record['error']}")
            results.append(record["result"])
        return results


def _command(argv: list[str], log: str, environ: dict) -> None:
    """`python ARGV...` in this process: runpy as `__main__` with its own argv and sys.path[0], stdout and
    stderr into `log`, in a process group of its own (a timeout kills its loader and compile workers too)."""
    os.setpgid(0, 0)
    _as_a_new_process(environ)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd in (1, 2):
        os.dup2(out, fd)
    if argv[0] == "-m":  # python -m MODULE: the working directory first on sys.path
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:  # python SCRIPT: the script's folder first on sys.path
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def run_commands(commands: dict[str, list[str]], logs: str, jobs: int = 2, timeout: float = 900) -> dict[str, int]:
    """Exit codes of the Python command lines `commands` (name -> argv after `python`), `jobs` at a time, each
    one's output in LOGS/NAME.log; 124 for one killed at `timeout` seconds, as `timeout` reports it. A command
    spent ~5 s importing torch, megatron and megamlm as a new interpreter; here the server has."""
    waiting, running, codes = list(commands.items()), {}, {}
    while waiting or running:
        while waiting and len(running) < jobs:
            name, argv = waiting.pop(0)
            process = CONTEXT.Process(target=_command, args=(argv, os.path.join(logs, f"{name}.log"), dict(os.environ)))
            process.start()
            running[process.sentinel] = (name, process, time.monotonic() + timeout)
        soonest = min(deadline for _, _, deadline in running.values())
        for sentinel in wait(list(running), timeout=max(0.0, soonest - time.monotonic())):
            name, process, _ = running.pop(sentinel)
            process.join()
            codes[name] = process.exitcode
        for sentinel, (name, process, deadline) in list(running.items()):
            if time.monotonic() >= deadline:
                os.killpg(process.pid, signal.SIGKILL)
                process.join()
                codes[name] = 124
                del running[sentinel]
    return codes
