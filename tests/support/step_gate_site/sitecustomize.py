"""The child half of ``support.step_gate``: loaded by Python at start-up (``sitecustomize``) in a
process whose ``PYTHONPATH`` names this directory. Inert unless ``LORAMESH_TEST_STEP_GATE``
names a gate file; then, once ``services.gpu_worker.engine.engine`` is imported, every
``Engine`` of the process steps only as many times as the gate file allows (an integer, the
total since start, or ``open``). Past that count the engine thread still takes new requests
and cancellations and runs the calls handed to ``Engine.between_steps`` (DGFM's recalls,
ListRequests...) at each step boundary, as when a DGFM stage is open, but no request decodes;
the number of steps taken is then written to ``<gate>.held``. Test-only: never on a product
path (docs/testing.md, "No verdict depends on the machine's speed").
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import math
import os
import sys
import threading

_GATE = os.environ.get("LORAMESH_TEST_STEP_GATE")
_ENGINE_MODULE = "services.gpu_worker.engine.engine"


class _Gate:
    def __init__(self, path: str):
        self.path = path
        self.taken = 0
        self.reported: int | None = None
        self.lock = threading.Lock()

    def allowed(self) -> float:
        try:
            with open(self.path) as f:
                text = f.read().strip()
        except FileNotFoundError:
            return 0
        return math.inf if text == "open" else int(text)

    def write(self, suffix: str, text: str) -> None:
        tmp = f"{self.path}{suffix}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, f"{self.path}{suffix}")

    def report_held(self) -> None:
        if self.reported != self.taken:
            self.write(".held", str(self.taken))
            self.reported = self.taken


def _install(module, gate: _Gate) -> None:
    engine_class = module.Engine
    original = engine_class._apply_between_steps  # AttributeError: the engine changed, fix the gate

    def _apply_between_steps(self) -> bool:
        if original(self):  # a DGFM stage is open: no step, as without the gate
            return True
        with gate.lock:
            if gate.taken < gate.allowed():
                gate.taken += 1
                return False
            gate.report_held()
        # Held: wait for work handed over (a call, a request, a cancel) or look again shortly.
        self.hand_over.wakeup.wait(0.2)
        self.hand_over.wakeup.clear()
        return True

    engine_class._apply_between_steps = _apply_between_steps
    gate.write(".installed", str(os.getpid()))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, gate: _Gate):
        self.gate = gate

    def find_spec(self, name, path, target=None):
        if name != _ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        gate = self.gate

        def exec_and_install(module) -> None:
            exec_module(module)
            _install(module, gate)

        spec.loader.exec_module = exec_and_install
        return spec


if _GATE:
    sys.meta_path.insert(0, _PatchOnImport(_Gate(_GATE)))
