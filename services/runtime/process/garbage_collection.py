"""Keep the objects a service builds at start-up out of the garbage collector's full passes.

A full (generation 2) collection traverses every container object the process holds. A worker
holds ~230,000 of them once its model, tokenizer and libraries are loaded, none of which ever
becomes garbage, and a full pass over them took 73 to 130 ms: on whichever thread allocated past
the threshold, with the GIL held, so the engine's decode step stalled for as long (a page-in's
bookkeeping allocates enough to set one off every few steps; bench/HISTORY.md).
``gc.freeze`` moves what is alive once the service is ready into a permanent generation that no
collection visits; objects made later are collected as before.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("loramesh.gc")


def freeze_startup_objects() -> int:
    """Collect once, then exempt every object alive from later collections; how many were."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%d start-up objects exempted from garbage collection", frozen)
    return frozen
