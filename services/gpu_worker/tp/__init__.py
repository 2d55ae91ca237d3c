"""Tensor parallelism: Megatron-style base sharding and S-LoRA's LoRA sharding (§6), exact.

Modules: ``layout`` (which slice each rank holds; no torch), ``sharding`` (base and adapter
shards, padding), ``collectives`` (all-reduce / all-gather with ring-model byte counts), ``context`` (what a rank's ``LlamaModel`` does: the
LoRA collectives and the base all-reduces), ``rank`` (build a rank's model and pool, page a
shard). The group's executor, its followers and their processes live in
``services/gpu_worker/executor/`` (``tensor_parallel``, ``follower``, ``tp_group``).

Communication per step (N ranks, T tokens, hidden h, element size e; ring model, bytes each rank
sends), per layer:

- base: two all-reduces of ``[T, h]`` (o, down): ``2 · 2(N−1)/N · T·h·e``;
- LoRA, column-parallel (q, k, v, gate, up): all-gather of the ``[T, r_pad]`` intermediate:
  ``(N−1)/N · Σ_t r_pad(t) · e`` per module, ``r_pad = N·ceil(r/N)``;
- LoRA, row-parallel (o, down): all-reduce of the ``[T, r]`` intermediate:
  ``2(N−1)/N · Σ_t r(t) · e`` per module;

where ``Σ_t`` runs over the tokens whose adapter targets the module, each with its adapter's rank
for that module (mixed ranks, rank patterns). Attention with q, k, v, o at one rank r that N
divides: ``5(N−1)·T·r·e/N`` (S-LoRA), against the attention all-reduce's ``2(N−1)·T·h·e/N``:
ratio ``5r/(2h)``. MLP (gate, up, down): ``4(N−1)·T·r·e/N``, ratio ``2r/h`` against the MLP
all-reduce. Intermediates are fp32 (``e`` = 4) whatever the model dtype.
"""
