"""What runs the engine's plans: the executors behind ``engine/executor.py``'s contract.

``local`` (one device: a model and its pool), ``tensor_parallel`` (rank 0 of a group, the one
driver of its followers: ``follower``, started and watched by ``tp_group``), ``step_builder`` (a
plan into the model's batch, on every rank) and ``plan_delta`` (a plan as the followers receive
it: what changed since the last step). Each executor owns its device buffers; the worker is
assembled by ``services/gpu_worker/build.py``.
"""
