"""Equality of two CPU byte ranges, large ones spread over the process's hashing pool.

Recording compares every in-place output with the bytes written before the call, to share the
blob when the kernel left it unchanged: for a call of hundreds of MB that is a read of twice its
size, which one thread does at a fraction of the memory bandwidth.
"""

from __future__ import annotations

import ctypes
import threading

memcmp = ctypes.CDLL(None).memcmp  # a foreign call: releases the GIL
memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
memcmp.restype = ctypes.c_int

SPLIT_MIN = 16 << 20  # smaller ranges are compared on the calling thread
PIECE = 4 << 20


def same(a: int, b: int, n: int) -> bool:
    """Whether the `n` bytes at addresses `a` and `b` are equal. The first piece is compared
    here (a changed output usually differs early); the rest in pieces on the hashing pool,
    which stop once one piece differed."""
    if n <= 0:
        return True
    first = min(n, PIECE)
    if memcmp(a, b, first) != 0:
        return False
    if n == first:
        return True
    from kdump.bundle.store import HASH_THREADS, on_pool_thread, pool

    # On a pool thread (or with one thread) the pool could be waiting on this very call.
    if n < SPLIT_MIN or HASH_THREADS == 1 or on_pool_thread():
        return memcmp(a + first, b + first, n - first) == 0
    differ = threading.Event()

    def piece(lo: int) -> bool:
        if differ.is_set():
            return False
        if memcmp(a + lo, b + lo, min(PIECE, n - lo)) != 0:
            differ.set()
            return False
        return True

    try:
        return all(list(pool().map(piece, range(first, n, PIECE))))
    except RuntimeError:  # no new work after interpreter shutdown (an atexit flush)
        return memcmp(a + first, b + first, n - first) == 0
