"""Registering the recorder's shared-memory files as pinned memory, in one place.

cudaHostRegister failing leaves its error as the CUDA runtime's "last error", and torch reports
the last error at its next kernel launch: the recorded program would see a CUDA error in an
unrelated operation. So a failed registration takes that error back at once (a tiny launch whose
check consumes it). A registration must end before its mapping does (a new mapping at the same
address cannot be registered while a stale registration covers it): the owner of the mapping
calls `unregister` before unmapping.
"""

from __future__ import annotations

from typing import Any

from kdump.record.journal import JournalError

# cudaHostRegister flags
PORTABLE = 1
MAPPED = 2  # the device may access it through its host address
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def register(addr: int, size: int, flags: int, what: str, device: Any = None) -> None:
    """Pin [addr, addr + size); JournalError (with the CUDA error) when the runtime refuses."""
    import torch

    err = int(torch.cuda.cudart().cudaHostRegister(addr, size, flags))
    if err == ALREADY_REGISTERED:
        # A registration left over from an earlier mapping at this address (unmapped without
        # being unregistered): the address range is ours now, so end it and try once more.
        _take_last_error(device)
        unregister(addr)
        err = int(torch.cuda.cudart().cudaHostRegister(addr, size, flags))
    if err == 0:
        return
    _take_last_error(device)
    raise JournalError(f"cudaHostRegister of {what} failed (CUDA error {err})")


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
