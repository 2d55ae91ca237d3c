"""Train the demo adapters once and reuse them: a folder per cache key under the cache root.

The key hashes everything the weights depend on: the source of the data and training modules,
the generated examples, the training config and the base model file's identity. Change any of
them and the next run trains afresh into a new folder; nothing stale is ever reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from demo_adapters import data, training
from demo_adapters.data import BEHAVIOURS, examples
from demo_adapters.training import TrainingConfig
from services.gpu_worker.model.cache_dir import CACHE_ENV
from services.runtime.base_model import default_model_path

#: Written last into a finished cache folder: what was trained, how long it took, final losses.
REPORT_FILE = "training.json"


def cache_root() -> Path:
    """``$LORAMESH_CACHE_DIR/demo-adapters``, else ``~/.cache/loramesh/demo-adapters``."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "loramesh") / "demo-adapters"


def base_model_identity(model_path: Path | None = None) -> str:
    """The base model file's name and size: a different model file means different adapters."""
    path = model_path or default_model_path()
    return f"{path.name}:{path.stat().st_size}"


def cache_key(config: TrainingConfig, base_identity: str) -> str:
    """A short hash of everything the adapters' weights depend on."""
    digest = hashlib.sha256()
    for module in (data, training):
        digest.update(Path(module.__file__).read_bytes())
    dataset = {name: [asdict(e) for e in examples(name)] for name in BEHAVIOURS}
    for part in (dataset, asdict(config), base_identity):
        digest.update(json.dumps(part, sort_keys=True, ensure_ascii=False).encode())
    return digest.hexdigest()[:16]


def ensure_adapters(
    config: TrainingConfig | None = None,
    root: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Path]:
    """Behaviour name -> PEFT folder of its adapter: from the cache, or trained now and cached.

    ``config`` defaults to ``TrainingConfig()``. Training writes into a temporary folder beside the final one and renames it when every
    adapter is saved, so an interrupted run leaves nothing that looks finished.
    """
    config = config or TrainingConfig()
    root = Path(root) if root is not None else cache_root()
    folder = root / cache_key(config, base_model_identity())
    if (folder / REPORT_FILE).is_file():
        log(f"reusing the demo adapters cached in {folder}")
    else:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".training-", dir=root))
        try:
            _train_all(config, staging, log)
            try:
                staging.rename(folder)
            except OSError:  # another run finished first: its adapters are the same
                if not (folder / REPORT_FILE).is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return {name: folder / name for name in BEHAVIOURS}


def _train_all(config: TrainingConfig, staging: Path, log: Callable[[str], None]) -> None:
    """Train every behaviour's adapter into ``staging``, then write the report."""
    started, cpu_started = time.perf_counter(), time.process_time()
    log(f"training {len(BEHAVIOURS)} demo adapters for the first time ({config.steps} steps each)")
    base = training.load_base_model()
    report = {"config": asdict(config), "load_s": round(time.perf_counter() - started, 1), "adapters": {}}
    for name in BEHAVIOURS:
        adapter_started = time.perf_counter()
        losses: list[float] = []
        training.train_adapter(base, examples(name), config, staging / name, on_step=_collect(losses))
        seconds = time.perf_counter() - adapter_started
        log(f"  {name}: {seconds:.0f} s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
        report["adapters"][name] = {"seconds": round(seconds, 1), "losses": [round(x, 4) for x in losses]}
    report["total_s"] = round(time.perf_counter() - started, 1)
    report["cpu_s"] = round(time.process_time() - cpu_started, 1)
    report["load_average"] = os.getloadavg()
    (staging / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    log(f"trained in {report['total_s']:.0f} s (load average {report['load_average'][0]:.1f})")


def _collect(losses: list[float]) -> Callable[[int, float], None]:
    """An ``on_step`` callback appending each step's loss to ``losses``."""
    return lambda step, loss: losses.append(loss)
