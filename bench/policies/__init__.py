"""Issue 15's batch-policy benchmarks: dLoRA skew sweep, S-LoRA abort vs FCFS vs LCFS, adapter
clustering, PetS DP prefill (``loramesh bench-policies``; see :mod:`bench.policies.runner`)."""
