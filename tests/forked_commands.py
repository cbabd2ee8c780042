"""Runs Python commands (`-m megamlm train ...`, `benchmarks/x.py ...`) as children forked from one process that
imported torch, megatron, DeepSpeed, transformers and megamlm once, two at a time: tests/test_gpu_script.py's toy
rows, ~60 of them, spent ~6 s each on those imports (most of a toy row) when each was a new interpreter.

    python tests/forked_commands.py COMMANDS.json JOBS   # [[name, [argv...], log_path, timeout_s], ...]
    PYTHON="python tests/forked_commands.py --print-argv" bash benchmarks/gpu.sh LOG_DIR STEP
                                                         # each command's argv as JSON in its log, quoting kept

Each child runs its command as `python ARGV...` would (`runpy`, `__main__`, its own argv and sys.path[0]),
its stdout and stderr in its log, in its own process group (a timeout kills its loader and compile workers
too). Prints {name: exit code} as JSON; 124 for a command killed at its timeout, as `timeout` does."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback


def _run_in_child(argv: list[str], log: str) -> None:
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    code = 0
    try:
        if argv[0] == "-m":  # python -m MODULE: the working directory first on sys.path
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python SCRIPT: the script's folder first on sys.path
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, exit 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what an interpreter's exit runs (multiprocessing's worker cleanup among them)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(commands: list[tuple[str, list[str], str, float]], jobs: int) -> dict[str, int]:
    waiting, running, codes = list(commands), {}, {}
    while waiting or running:
        while waiting and len(running) < jobs:
            name, argv, log, timeout = waiting.pop(0)
            pid = os.fork()
            if pid == 0:
                _run_in_child(argv, log)
            running[pid] = (name, time.monotonic() + timeout)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[running.pop(pid)[0]] = os.waitstatus_to_exitcode(status)
            continue
        for child, (_, deadline) in list(running.items()):
            if time.monotonic() > deadline:
                os.killpg(child, signal.SIGKILL)
                os.waitpid(child, 0)
                codes[running.pop(child)[0]] = 124
        time.sleep(0.05)
    return codes


def _main() -> None:
    import deepspeed  # noqa: F401 - imported once here, for every child
    import megamlm.cli  # noqa: F401
    import megamlm.train.loop  # noqa: F401
    import transformers  # noqa: F401

    with open(sys.argv[1]) as listing:
        print(json.dumps(run(json.load(listing), int(sys.argv[2]))))


if __name__ == "__main__":
    if sys.argv[1] == "--print-argv":
        print(json.dumps(sys.argv[2:]))
    else:
        _main()
