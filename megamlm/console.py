"""Lines megamlm prints where other processes print too: GLUE tasks in parallel processes and the
process that reports them, the ranks of a torchrun job sharing one terminal or SLURM log.

`print(text)` hands the text and its newline to the stream in two calls; under PYTHONUNBUFFERED=1 or
`python -u` (common in containers and job scripts) each is its own write, and another process's line can
land between them: "RTE ... epoch 172/300 ... | 0sSTS-B: finished (1 of 3 tasks)" in a `glue --parallel 2`
log. `print_line` hands the line with its newline over in one call, one write however the stream buffers,
which a pipe takes whole (POSIX: a write of at most PIPE_BUF bytes, 4 KiB on Linux, is never interleaved)
as a terminal or a file opened for appending does.
"""

from __future__ import annotations

import os
import select
import sys
from typing import TextIO

READER_GONE_EXIT = 141
"""Exit status where our output's reader has gone (`megamlm shards inspect DIR | head`): 128 + SIGPIPE, what a
shell reports for a tool that SIGPIPE ends (Python ignores SIGPIPE and raises BrokenPipeError instead)."""


def print_line(text: str, file: TextIO | None = None) -> None:
    """`text` and a newline in one write to `file` (stdout: looked up at the call, so a redirected
    sys.stdout is honoured), flushed at once: a job's log shows it now, not when a buffer fills."""
    stream = sys.stdout if file is None else file
    stream.write(text + "\n")
    stream.flush()


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end has closed (`| head` after its lines): the writing end of such a
    pipe polls as an error. A BrokenPipeError from elsewhere (a worker's pipe) leaves stdout as it was."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stdout), or no poll
        return False


def leave_quietly_for_a_gone_reader() -> int:
    """READER_GONE_EXIT, with stdout pointed at /dev/null: what is left in its buffer would raise again as Python
    flushes it at exit ("Exception ignored ... BrokenPipeError")."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return READER_GONE_EXIT
