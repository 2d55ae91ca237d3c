"""Keep freed buffers in the process for reuse instead of handing them back to the kernel.

glibc serves an allocation of more than its mmap threshold (128 KiB, growing on its own only
up to the largest block freed so far) with a fresh mapping, and trims the heap's free top back
to the kernel. A service that moves megabytes per request through transient buffers (an upload
arrives as messages of up to 4 MiB, is joined, hashed and written) then takes a page fault and a
zeroed page for every 4 KiB of every buffer: on a 2-vCPU VM that cost the adapter store more CPU
than hashing the bytes (bench/HISTORY.md). Raising both thresholds makes those buffers
come from, and go back to, the heap. The price: the heap keeps the peak of what was in flight
(for the store, the uploads it held at once) rather than shrinking after it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("loramesh.allocator")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
LARGEST_HEAP_BLOCK = 32 << 20
"""glibc's ceiling for the mmap threshold on 64-bit: a larger allocation is still mapped."""
_NEVER_TRIM = 2**31 - 1
"""The largest trim threshold mallopt takes (an int): the heap's free top is never trimmed."""


def retain_freed_memory() -> bool:
    """Serve blocks up to :data:`LARGEST_HEAP_BLOCK` from the heap and never trim it. True
    when the C library took both settings; False where it is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no mallopt in this C library (%s): freed memory goes back as it did", name)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    taken = mallopt(_M_MMAP_THRESHOLD, LARGEST_HEAP_BLOCK) == 1
    return mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1 and taken
