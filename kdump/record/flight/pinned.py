"""Registering the recorder's shared-memory files as pinned memory, in one place.

cudaHostRegister failing leaves its error as the CUDA runtime's "last error", and torch reports
the last error at its next kernel launch: the recorded program would see a CUDA error in an
unrelated operation. So a failed registration takes that error back at once (a tiny launch whose
check consumes it). A registration must end before its mapping does (a new mapping at the same
address cannot be registered while a stale registration covers it): the owner of the mapping
ends it before unmapping (`register` returns the call that does), and a registration whose owner is
collected without closing (a failed test's journal, an exception past the recorder) ends then.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kdump.format.journal import JournalError

# cudaHostRegister flags
PORTABLE = 1
MAPPED = 2  # the device may access it through its host address
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def register(
    addr: int,
    size: int,
    flags: int,
    what: str,
    owner: object,
    device: Any = None,
    path: Path | None = None,
) -> Callable[[], None]:
    """Pin [addr, addr + size), the mapping `owner` holds; returns the call that ends the
    registration (idempotent; it also runs when `owner` is collected). JournalError (with the CUDA
    error) when the runtime refuses."""
    import torch

    err = int(torch.cuda.cudart().cudaHostRegister(addr, size, flags))
    first = err
    if err == ALREADY_REGISTERED:
        # A registration left over from an earlier mapping at this address (unmapped without
        # being unregistered): the address range is ours now, so end it and try once more.
        _take_last_error(device)
        unregister(addr)
        err = int(torch.cuda.cudart().cudaHostRegister(addr, size, flags))
    if err == 0:
        end = weakref.finalize(owner, unregister, addr)
        end.atexit = False  # at exit the process's registrations end with it
        return end
    _take_last_error(device)
    tried = f"; first CUDA error {first}" if first != err else ""
    hint = ""
    fs = filesystem_of(path) if path is not None else None
    if fs is not None and fs not in SHARED_MEMORY_FS:
        hint = (
            f": {path.parent} is on {fs}, and CUDA pins file-backed memory only in shared memory;"
            " put the journals under /dev/shm (KDUMP_JOURNAL_DIR)"
        )
    raise JournalError(f"cudaHostRegister of {what} failed (CUDA error {err}{tried}){hint}")


SHARED_MEMORY_FS = frozenset({"tmpfs", "hugetlbfs", "ramfs", "shm"})


def filesystem_of(path: Path) -> str | None:
    """The type of the file system holding `path` (the longest mount point above it in
    /proc/self/mounts), or None where that cannot be told."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
        real = os.path.realpath(path)
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) > best[0]):
            best = (len(mount), parts[2])
    return best[1] if best else None


def unregister(addr: int) -> None:
    """End a registration (never raises: the recorder's clean-up must not break the program)."""
    import torch

    try:
        if int(torch.cuda.cudart().cudaHostUnregister(addr)) != 0:
            _take_last_error(None)
    except Exception:
        pass


def _take_last_error(device: Any) -> None:
    import torch

    try:
        torch.zeros(1, device=device if device is not None else "cuda").add_(1)
    except Exception:  # the stale error, reported here instead of in the program
        pass
