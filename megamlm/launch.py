"""Launch helpers: DeepSpeed hostfiles from SLURM allocations or host lists.

    megamlm hostfile --slots 8 --out hostfile          # inside an allocation (SLURM_JOB_NODELIST)
    megamlm hostfile --hosts node1,node2 --slots 8
    deepspeed --hostfile hostfile --no_local_rank --module megamlm train --config ...
"""

from __future__ import annotations

import os
import subprocess

from megamlm.errors import MegamlmError


def slurm_hosts() -> list[str]:
    """Host names of the current SLURM allocation, in order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise MegamlmError("SLURM_JOB_NODELIST is not set: run inside an allocation or pass --hosts")
    result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                            text=True, check=True)
    return result.stdout.split()


def hostfile_text(hosts: list[str], slots: int) -> str:
    """DeepSpeed's hostfile format: `<host> slots=<processes>` per line."""
    if slots < 1:
        raise MegamlmError(f"--slots {slots} must be >= 1")
    if not hosts or any(not h or h.strip() != h for h in hosts):
        raise MegamlmError(f"invalid host list {hosts!r}")
    return "".join(f"{host} slots={slots}\n" for host in hosts)
