"""Benchmarks: the S-LoRA reproduction (`loramesh bench`) and component benches."""
