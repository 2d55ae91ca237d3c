"""A step's local query groups as one: one attention call per layer instead of one per group.

A step that verifies drafts has each drafting request's ``1 + k`` rows as a group of its own (a
prefill-like span, ``chunked_attention.local_queries``) beside the decode group: one native call
per group and layer, each paying its Python call and its OpenMP fork, and each split over the
threads alone (one request's 3 kv heads of SmolLM2 on 2 threads: 2 items against 1). Merged,
every query of the step is one call whose items the threads share. Each query still reads its
own table's blocks into its own tree, so no bit changes (``kernels/cpu_invariant_attention.c``).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from services.gpu_worker.attention.chunked_attention import LocalQueries


def merged_queries(groups: list[LocalQueries]) -> list[LocalQueries]:
    """``groups`` as one group: their rows one after the other, their tables side by side
    (padded with page 0 to the widest: a query reads only its own context's blocks)."""
    if len(groups) <= 1:
        return groups
    width = max(group.tables.shape[2] for group in groups)
    tables = torch.cat([F.pad(group.tables, (0, width - group.tables.shape[2])) for group in groups], dim=1)
    offsets = itertools.accumulate((group.tables.shape[1] for group in groups), initial=0)
    return [
        LocalQueries(
            torch.cat([group.rows for group in groups]),
            torch.cat([group.table_of_row + offset for group, offset in zip(groups, offsets)]),
            tables.contiguous(),
        )
    ]
