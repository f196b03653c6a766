"""How a service's process keeps its memory returnable: large buffers mapped on their own, and the memory glibc keeps
free in its arenas handed back to the system after a burst (bus/service.py calls both; elsewhere than glibc, nothing
is tuned)."""

from __future__ import annotations

import ctypes

# glibc's default mmap threshold, made fixed: left dynamic, glibc raises it to the size of the largest buffer freed (up
# to 32 MiB), and from then on every message and reply up to that size is carved from the heap, where the small live
# objects around it keep the space from ever being returned.
MMAP_THRESHOLD_BYTES = 128 * 1024


def _glibc() -> ctypes.CDLL | None:
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None  # elsewhere: nothing to tune


_GLIBC = _glibc()
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h


def keep_large_buffers_out_of_the_heap() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES, so large buffers are mapped and unmapped on their own."""
    if _GLIBC is not None:
        _GLIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def release_freed_memory() -> None:
    """Hand the memory that glibc keeps free in its arenas (libzmq's I/O thread's included) back to the system."""
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)
