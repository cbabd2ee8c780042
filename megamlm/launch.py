"""Launch helpers: DeepSpeed hostfiles from SLURM allocations or host lists.

    megamlm hostfile --slots 8 --out hostfile          # inside an allocation (SLURM_JOB_NODELIST)
    megamlm hostfile --hosts node1,node2 --slots 8
    deepspeed --hostfile hostfile --no_local_rank --module megamlm train --config ...
"""

from __future__ import annotations

import os
import re
import subprocess

from megamlm.errors import MegamlmError


def slurm_hosts() -> list[str]:
    """Host names of the current SLURM allocation, in order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise MegamlmError("SLURM_JOB_NODELIST is not set: run inside an allocation or pass --hosts")
    command = ["scontrol", "show", "hostnames", nodelist]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError:
        raise MegamlmError(f"SLURM_JOB_NODELIST={nodelist} but scontrol, which expands it, is not on PATH: "
                           "run inside the allocation or pass --hosts") from None
    if result.returncode != 0 or not result.stdout.split():
        said = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}, no host"])[-1]
        raise MegamlmError(f"`{' '.join(command)}` failed: {said}")
    return result.stdout.split()


def _host_problem(host: str) -> str:
    """Why `host` cannot start a hostfile line ("" where it can): DeepSpeed splits a line at its blanks, and
    `gpu2:8` is another launcher's host:slots (an IPv6 address, two colons or more, is a host)."""
    if not host or host.split() != [host]:
        return f"{host!r} is not a host name"
    if re.fullmatch(r"[^:]+:\d+", host):
        return f"{host!r} is not a host name (--slots sets the processes per host)"
    return ""


def hostfile_text(hosts: list[str], slots: int) -> str:
    """DeepSpeed's hostfile format: `<host> slots=<processes>` per line."""
    if slots < 1:
        raise MegamlmError(f"--slots {slots} must be >= 1")
    problems = [problem for problem in map(_host_problem, hosts) if problem]
    if not hosts or problems:
        raise MegamlmError(f"invalid host list {hosts!r}: {problems[0] if problems else 'empty'}")
    return "".join(f"{host} slots={slots}\n" for host in hosts)
