"""`loramesh up` refuses, in one line and before anything starts, a setting one of its services
would refuse: a flag it passes on (``--tp 0``) or a ``LORAMESH_*`` variable of its environment
the service reads (``LORAMESH_DETERMINISTIC=enabled``), naming the service and the setting; and
``--kv-managers 0`` (no DistKV) is taken, the workers then preempting (the mesh it starts:
tests/cli/test_cli.py), unless ``--kv-overflow borrow`` asks for what needs a kv_manager."""

from __future__ import annotations

import pytest

from loramesh_cli.main import main

ON_OFF = "expected on (1, true, yes, on) or off (0, false, no, off)"


@pytest.mark.parametrize(
    ("flags", "environ", "reason"),
    [
        (["--tp", "0"], {}, "gpu_worker: --tp (env LORAMESH_TP) must be at least 1, got 0"),
        (["--tp", "-2"], {}, "gpu_worker: --tp (env LORAMESH_TP) must be at least 1, got -2"),
        ([], {"LORAMESH_TP": "0"}, "gpu_worker: --tp (env LORAMESH_TP) must be at least 1, got 0"),
        (["--tp", "2"], {}, "gpu_worker: --tp 2 does not divide "),  # the base model's heads: 1 or 3
        (["--pool-mib", "0"], {}, "gpu_worker: --pool-mib (env LORAMESH_POOL_MIB) must be more than 0, got 0.0"),
        ([], {"LORAMESH_DETERMINISTIC": "enabled"},
         f"gpu_worker: LORAMESH_DETERMINISTIC (setting --deterministic): {ON_OFF}, got 'enabled'"),
        ([], {"LORAMESH_RETAIN_FREED_MEMORY": "maybe"},
         f"adapter_store: LORAMESH_RETAIN_FREED_MEMORY (setting --retain-freed-memory): {ON_OFF}, got 'maybe'"),
        ([], {"LORAMESH_MAX_QUEUE_PER_WORKER": "0"},
         "scheduler: --max-queue-per-worker (env LORAMESH_MAX_QUEUE_PER_WORKER) must be at least 1, got 0"),
        ([], {"LORAMESH_DGFM_INTERVAL_S": "soon"},
         "kv_manager: LORAMESH_DGFM_INTERVAL_S (setting --dgfm-interval-s): expected a number, got 'soon'"),
        (["--kv-managers", "-1"], {}, "--kv-managers must be 0 (no DistKV: the workers preempt) or more, got -1"),
        (["--kv-managers", "0", "--kv-overflow", "borrow"], {},
         "--kv-overflow borrow needs a kv_manager to suggest creditors; --kv-managers 0 runs none"),
    ],
)  # fmt: skip
def test_up_refuses_what_a_service_would_refuse_naming_it(
    flags, environ, reason, tmp_path, monkeypatch, capsys
):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert main(["--state-dir", str(tmp_path / "state"), "up", "--detach", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loramesh: " + reason) and len(err.splitlines()) == 1, err
    assert not (tmp_path / "state").exists()
