"""Issue 13's long-context benchmark: DistKV-LLM borrowing across real gpu_worker processes
against preempt+recompute, each worker alone, and all KV on one worker (``experiment.py``)."""
