"""The S-LoRA reproduction: adapters, metrics, experiments, reports (``loramesh bench``)."""
