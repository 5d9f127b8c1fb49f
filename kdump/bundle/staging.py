"""Device spans to the host and compared on the device: chunks staged through pinned buffers
(the copy of the next overlapping the use of the current one), a device span written to a file
while hashed, and comparisons of device spans with earlier copies of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kdump.bundle import bytecmp
from kdump.bundle.fileio import Digester, Digests, address_of, cpu_view, pwrite_all
from kdump.bundle.store import ProcessPool, pool, submit_or_run

STAGE_CHUNK = 16 << 20  # pinned staging buffer per device copy (two per span being copied)


DEVICE_COMPARE_CHUNK = 64 << 20  # bytes per device comparison (its temporary: an eighth)


# The process's file-write pool (os.pwrite releases the GIL). Separate from the hashing pool so
# that a hashing job may wait on writes without ever waiting on itself.
io_pool = ProcessPool("kdump-write")


def caller_streams(sources: Sequence[torch.Tensor]) -> dict[torch.device, Any]:
    """The caller's current stream of each device involved: the staging copies wait for the
    work queued on it (the producers of the bytes)."""
    out: dict[torch.device, Any] = {}
    for s in sources:
        if s.device.type == "cuda" and s.device not in out:
            out[s.device] = torch.cuda.current_stream(s.device)
    return out


def _staged(src: torch.Tensor, after: Any) -> Iterator[tuple[int, memoryview]]:
    """(offset, host bytes) of a device span, chunk by chunk, through two pinned staging
    buffers: chunk k+1 is being copied on a side stream (after the work queued on `after`) while
    the caller uses chunk k. A chunk's bytes are valid until the next one is asked for."""
    n = src.numel()
    if n == 0:
        return
    with torch.cuda.device(src.device):
        side = torch.cuda.Stream(src.device)
        side.wait_stream(after)
        chunk = min(STAGE_CHUNK, n)
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        views = [cpu_view(b) for b in bufs]
        events = [torch.cuda.Event(), torch.cuda.Event()]

        def issue(k: int) -> None:
            lo = k * chunk
            part = src[lo : lo + chunk]
            with torch.cuda.stream(side):
                bufs[k % 2][: part.numel()].copy_(part, non_blocking=True)
                events[k % 2].record(side)

        count = -(-n // chunk)
        issue(0)
        try:
            for k in range(count):
                events[k % 2].synchronize()
                if k + 1 < count:
                    issue(k + 1)  # into the buffer the caller finished with
                lo = k * chunk
                yield lo, views[k % 2][: min(n, lo + chunk) - lo]
        finally:
            side.synchronize()  # no copy may still target the buffers once they are released


def write_device(fd: int, src: torch.Tensor, at: int, after: Any) -> Digests:
    """Copy a device span to the file at offset `at`: each staged chunk is written on the write
    pool while it is hashed here."""
    d = Digester()
    for lo, piece in _staged(src, after):
        write = submit_or_run(io_pool().submit, pwrite_all, fd, piece, at + lo)
        try:
            d.update(piece)
        finally:
            write.result()  # before the buffer is reused
    return d.digests()


def equal_on_device(a: torch.Tensor, b: torch.Tensor, after: Any) -> bool:
    """Whether two device spans of one size hold the same bytes, compared on the device after
    the work queued on `after`, in pieces (the comparison's temporary stays small); False when
    the device cannot say (e.g. out of memory: the span is then written, as before)."""
    n = a.numel()
    if n != b.numel() or a.device != b.device:
        return False
    try:
        with torch.cuda.device(a.device):
            side = torch.cuda.Stream(a.device)
            side.wait_stream(after)
            with torch.cuda.stream(side):
                for lo in range(0, n, DEVICE_COMPARE_CHUNK):
                    x, y = a[lo : lo + DEVICE_COMPARE_CHUNK], b[lo : lo + DEVICE_COMPARE_CHUNK]
                    if x.numel() % 8 == 0 and x.data_ptr() % 8 == 0 and y.data_ptr() % 8 == 0:
                        x, y = x.view(torch.int64), y.view(torch.int64)
                    if not torch.equal(x, y):
                        return False
        return True
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return False


def _same_device(src: torch.Tensor, snapshot: torch.Tensor, after: Any) -> bool:
    """Whether a device span holds the bytes of a host snapshot, compared chunk by chunk as
    they arrive (stops at the first chunk that differs)."""
    if src.numel() != snapshot.numel():
        return False
    base = snapshot.data_ptr()
    for lo, piece in _staged(src, after):
        if bytecmp.memcmp(address_of(piece), base + lo, len(piece)) != 0:
            return False
    return True


def same_as_device_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """For each (device span, device copy made before the call) pair: whether they hold the same
    bytes, compared on the device after the work queued on the caller's streams (False where the
    device cannot say: the span is then written)."""
    streams = caller_streams([src for src, _ in pairs])
    return [equal_on_device(src, copy, streams[src.device]) for src, copy in pairs]


def same_on_device(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """For each (device span, host snapshot) pair: whether they hold the same bytes (the spans
    compared in parallel, after the work queued on the caller's streams)."""
    streams = caller_streams([src for src, _ in pairs])
    jobs = [
        submit_or_run(pool().submit, _same_device, src, snap, streams[src.device])
        for src, snap in pairs
    ]
    return [j.result() for j in jobs]
