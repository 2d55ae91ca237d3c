"""Train the demo adapters once and reuse them: a folder per cache key under the cache root.

The key hashes everything the weights depend on: the source of the data and training modules,
the generated examples, the training config and the base model file's identity. Change any of
them and the next run trains afresh into a new folder; nothing stale is ever reused.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from demo_adapters import data, training
from demo_adapters.data import BEHAVIOURS, examples
from demo_adapters.training import DEMO_CONFIGS, TrainingConfig
from services.model_files.base_model import default_model_path
from services.model_files.cache_dir import CACHE_ENV

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


def cache_key(configs: dict[str, TrainingConfig], base_identity: str) -> str:
    """A short hash of everything the adapters' weights depend on."""
    dataset = {name: [asdict(e) for e in examples(name)] for name in BEHAVIOURS}
    trainings = {name: asdict(config) for name, config in configs.items()}
    return source_and_parts_key((data, training), (dataset, trainings, base_identity))


def source_and_parts_key(modules: tuple, parts: tuple) -> str:
    """A short hash of the source of ``modules`` and of ``parts`` (JSON): a cache folder's key."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    for part in parts:
        digest.update(json.dumps(part, sort_keys=True, ensure_ascii=False).encode())
    return digest.hexdigest()[:16]


def build_once(folder: Path, done: str, build: Callable[[Path], None]) -> Path:
    """``folder``, made by ``build(staging)`` unless its file ``done`` is there already. ``build``
    writes into a staging folder beside it, renamed when ``build`` returns, so an interrupted run
    leaves nothing that looks finished."""
    if (folder / done).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".training-", dir=folder.parent))
    try:
        build(staging)
        try:
            staging.rename(folder)
        except OSError:  # another run finished first: what it made is the same
            if not (folder / done).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def ensure_adapters(
    configs: dict[str, TrainingConfig] | None = None,
    root: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Path]:
    """Behaviour name -> PEFT folder of its adapter: from the cache, or trained now and cached.

    ``configs`` (behaviour -> how its adapter is trained) defaults to ``DEMO_CONFIGS``. Training
    writes into a temporary folder beside the final one and renames it when every adapter is
    saved, so an interrupted run leaves nothing that looks finished.
    """
    configs = configs or DEMO_CONFIGS
    root = Path(root) if root is not None else cache_root()
    folder = root / cache_key(configs, base_model_identity())
    if (folder / REPORT_FILE).is_file():
        log(f"reusing the demo adapters cached in {folder}")
    build_once(folder, REPORT_FILE, lambda staging: _train_all(configs, staging, log))
    return {name: folder / name for name in configs}


def _train_all(configs: dict[str, TrainingConfig], staging: Path, log: Callable[[str], None]) -> None:
    """Train every behaviour's adapter into ``staging``, each in a process of its own (they
    share the cores; see ``training.train_alone``), then write the report."""
    started, cpu_started = time.perf_counter(), time.process_time()
    steps = ", ".join(f"{name} {config.steps}" for name, config in configs.items())
    log(f"training {len(configs)} demo adapters for the first time, in parallel (steps: {steps})")
    report = {"configs": {name: asdict(config) for name, config in configs.items()}, "adapters": {}}
    # spawn: a forked child would inherit this process's torch thread pool, if it has one.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(configs), mp_context=context) as pool:
        futures = {pool.submit(training.train_alone, name, config, staging / name): name
                   for name, config in configs.items()}  # fmt: skip
        for future in as_completed(futures):
            name, trained = futures[future], future.result()
            losses = trained["losses"]
            log(f"  {name}: {trained['seconds']:.0f} s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
            report["adapters"][name] = trained
    report["total_s"] = round(time.perf_counter() - started, 1)
    children_cpu_s = sum(trained["cpu_s"] for trained in report["adapters"].values())
    report["cpu_s"] = round(time.process_time() - cpu_started + children_cpu_s, 1)
    report["load_average"] = os.getloadavg()
    (staging / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    log(f"trained in {report['total_s']:.0f} s, {report['cpu_s']:.0f} CPU-s "
        f"(load average {report['load_average'][0]:.1f})")  # fmt: skip
