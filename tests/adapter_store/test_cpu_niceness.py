"""``--cpu-nice``: the store's threads and its session's autogroup yield the CPU to decoding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.adapter_store.config import AdapterStoreConfig

# Lowers its priority, starts a thread afterwards, and reports each live thread's niceness and
# its session's autogroup niceness. A joined thread can still be listed in /proc/self/task for a
# moment while it exits (ESRCH then), so the probe skips it. A session in the kernel's root task
# group (the init session of a container, say) reads an empty /proc/self/autogroup: no autogroup.
PROBE = """
import json, os, threading
from pathlib import Path
from services.adapter_store.cpu_niceness import lower_cpu_priority
def niceness(tid):
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:
        return None
before = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
before.start()
lower_cpu_priority(int(os.environ["NICE"]))
after = []
thread = threading.Thread(target=lambda: after.append(os.getpriority(os.PRIO_PROCESS, 0)))
thread.start(); thread.join()
group = Path("/proc/self/autogroup").read_text().split() if Path("/proc/self/autogroup").exists() else []
print(json.dumps({
    "threads": [n for n in (niceness(int(t)) for t in os.listdir("/proc/self/task")) if n is not None],
    "started_after": after[0],
    "autogroup": group[-1] if group else None,
}))
"""


def run_probe(niceness: int, own_session: bool) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={"NICE": str(niceness), "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        capture_output=True,
        text=True,
        check=False,
        start_new_session=own_session,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_session_leader_lowers_its_threads_and_its_autogroup():
    seen = run_probe(7, own_session=True)
    assert len(seen["threads"]) >= 2 and all(nice == 7 for nice in seen["threads"])
    assert seen["started_after"] == 7
    if seen["autogroup"] is not None:  # a kernel with autogroups
        assert seen["autogroup"] == "7"


def test_a_process_inside_another_session_leaves_that_session_alone():
    mine = Path("/proc/self/autogroup")
    line = mine.read_text().split() if mine.exists() else []
    seen = run_probe(5, own_session=False)
    assert all(nice == 5 for nice in seen["threads"])
    assert seen["autogroup"] == (line[-1] if line else None)


def test_zero_changes_nothing():
    seen = run_probe(0, own_session=True)
    assert all(nice == 0 for nice in seen["threads"])
    if seen["autogroup"] is not None:
        assert seen["autogroup"] == "0"


def test_out_of_range_is_refused():
    with pytest.raises(ValueError, match="--cpu-nice must be 0 to 19"):
        AdapterStoreConfig(cpu_nice=20)
