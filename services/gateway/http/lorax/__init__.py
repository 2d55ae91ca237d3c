"""LoRAX's REST API: ``POST /``, ``/generate``, ``/generate_stream``."""
