"""Run a function on N real processes joined by a gloo group, from inside one pytest test.

Each rank is a new process (torch and gloo state start clean), forked from a server process that
imported torch, megatron-core, DeepSpeed and megamlm once for the whole session: a spawned rank
spent ~5 s importing them, in every multi-rank run of the suite. Each rank gets the
test's current environment plus torchrun's variables, runs `fn(*args)` and returns its result
through a file. A failure on any rank re-raises in the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# imported once by the fork server (a module that fails to import is left to the rank to import)
PRELOAD = ["torch", "megatron.core", "deepspeed", "transformers", "megamlm.train.loop", "megamlm.glue"]
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(PRELOAD)


def _worker(rank: int, world_size: int, port: int, out_dir: str, environ: dict, fn, args) -> None:
    # the server's environment is the one of its start: the test's own is what a spawned rank saw
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    # a fork server's child inherits "forkserver" as its default start method; a torchrun rank has
    # none set, so its data-loader workers fork (and do not import torch again in a new server)
    mp.set_start_method(None, force=True)
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
