"""Silence what native libraries print straight to the process's stdout/stderr.

Some libraries memfit calls write to file descriptors 1 or 2 from C++ (the CPU profiler's
"profiler_start" lines, HiGHS's progress lines), bypassing Python's ``sys.stdout``; they would
corrupt ``--json`` output and litter every report. Only the library call is silenced: the
descriptor is restored before control returns to user code.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["silenced_fd"]


@contextlib.contextmanager
def silenced_fd(fd: int) -> Iterator[None]:
    """Point file descriptor ``fd`` (1 or 2) at /dev/null for the duration of the block."""
    stream = sys.stdout if fd == 1 else sys.stderr
    with contextlib.suppress(AttributeError, OSError, ValueError):  # stream replaced or closed
        stream.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            try:
                yield
            finally:
                os.dup2(saved, fd)
    finally:
        os.close(saved)
