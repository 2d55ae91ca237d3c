"""A fuzz campaign over every entry point of the mesh (bench/fuzz_campaign.py)."""
