"""The serving systems the S-LoRA reproduction drives with the same trace and clock."""
