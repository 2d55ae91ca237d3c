"""Batched multi-adapter LoRA kernels over the unified pool (S-LoRA §5.3).

``lora_segments`` describes one batch's LoRA work; ``torch_reference`` (CPU path, ground truth),
``padded_bmm`` (the paper's bmm ablation), ``cpu_native`` (a C kernel compiled at first use, the
CPU default) and ``triton_lora`` (MBGMM/MBGMV on GPUs) implement it, ``triton_stacked_lora``
the projections that read one input (q/k/v, gate/up) in one decode launch pair;
``dispatch`` picks one (``add_lora_delta``; ``StepLora`` for the model's calls, prepared once per
batch). Nothing here imports triton at package import: the Triton
module is loaded on first use so ``TRITON_INTERPRET`` can be set before its kernels are defined.
"""
