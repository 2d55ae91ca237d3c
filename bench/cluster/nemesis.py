"""One nemesis round over a running overlay (issue 49): the seeded fault schedule done to the
pods (faults.py) while the load (load.py) streams, borrows and uploads through the gateways, then
the checker's verdict over what the clients were told and what was observed.

What is observed besides the history, all on the machine's monotonic clock (the history's):

- the workers' load reports in etcd, every 2 s (cluster_watch.py, in an etcd pod's namespace):
  the ledger's snapshots, the last one once the load has stopped and the loans are back;
- the kv_manager leaders' terms and the workers' fenced writes, from their JSON log lines
  (loggers ``loramesh.leader`` and ``loramesh.leader_fence``, docs/operations.md "kv_manager
  leadership and fencing");
- each pod's readiness every 0.5 s (the kubelet's readiness probes), and the first operation a
  client completed after each heal: time to serving;
- the store at the end (listed, and every uploaded name fetched), by the load.

The schedule's clock starts once the load has invoked its first operation (the load's own start,
importing the model's code, takes seconds to tens of seconds on a loaded machine): the warm-up and
the first faults then find the load running however long it took to start.

Before the final observations the round waits for every pod to be ready again (a hang guard
bounds it, not a timing claim): a pod restarted late is slow, not lost.
"""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.cluster.checker import Verdict, check
from bench.cluster.faults import Applied, FaultExecutor
from bench.cluster.history import History, Op, Outcome
from bench.cluster.load import read_store
from bench.cluster.observations import BlockReport, Heal, LeaderTerm, LeaderWrite, LedgerSnapshot
from bench.cluster.pods.runner import OverlayRun, gateway_addresses
from bench.cluster.schedule import ClusterShape, Event, NemesisKind, Role, ScheduleConfig, fault_schedule
from bench.cluster.stalls import stalls_at

ROLES = {
    "StatefulSet/etcd": Role.ETCD,
    "Deployment/gpu-worker": Role.WORKER,
    "Deployment/gateway": Role.GATEWAY,
    "Deployment/scheduler": Role.SCHEDULER,
    "Deployment/kv-manager": Role.KV_MANAGER,
    "Deployment/adapter-store": Role.STORE,
}
"""The overlay's workloads the nemesis acts on (etcd-rbac-sync is an operator's job, not the mesh)."""
READINESS_POLL_S = 0.5
KV_POOL_MIB = 18
"""Each worker's pool: 25 blocks of 16 tokens in float32 (SmolLM2-135M: 720 KiB a block), so the
load's ~520-token prompts overflow it and borrow (tests/integration/test_distkv.py's sizing)."""


def worker_patch(deterministic: bool = False) -> str:
    """The run's patch of the workers: float32 (the references' dtype), a pool the long prompts
    overflow, and batch-invariant numerics when streams are judged token for token."""
    env = {"LORAMESH_DTYPE": "float32", "LORAMESH_POOL_MIB": str(KV_POOL_MIB),
           "LORAMESH_DETERMINISTIC": "true" if deterministic else "false"}  # fmt: skip
    items = "".join(f'            - name: {k}\n              value: "{v}"\n' for k, v in env.items())
    return (
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: gpu-worker\n  namespace: loramesh\n"
        "spec:\n  template:\n    spec:\n      containers:\n        - name: gpu-worker\n          env:\n"
        + items
    )


HANG_GUARD_S = 900.0
"""Bound on each wait for the cluster (ready again, the load's end, the loans back): a hang guard."""


@dataclass(frozen=True)
class NemesisConfig:
    """One round."""

    kinds: tuple[NemesisKind, ...]
    duration_s: float
    seed: int
    client: str
    """The client pod the load runs in."""
    out: Path
    """Where the history, observations and verdict are written."""
    deterministic: bool = False
    """The workers serve batch-invariant numerics: streams are judged token for token."""
    heal_bound_s: float = 600.0
    """How long after a heal a service may take to serve again: generous, a worker restarted on
    a loaded 2-core machine loads its model in minutes; the verdict must not depend on speed."""
    hang_guard_s: float = HANG_GUARD_S
    """Bound on each wait for the cluster after the faults (every pod ready again, the load's
    end, every loan back): a hang guard, never a deadline on the work. A test sets it so that
    a stuck round fails inside the test's own timeout, with what it was waiting for."""
    warmup_s: float = 10.0
    fault_s: tuple[float, float] = (5.0, 15.0)
    quiet_s: tuple[float, float] = (5.0, 10.0)
    tail_s: float = 15.0


@dataclass
class RoundResult:
    verdict: Verdict
    ops: tuple[Op, ...]
    applied: list[tuple[float, float, Applied]]
    """(started, healed, fault) on the history's clock."""
    heals: list[Heal]
    snapshots: list[LedgerSnapshot]
    report: str = ""
    most_lent: int = 0
    """The most blocks lent at once (all workers): the load did borrow when > 0."""
    timings: dict[str, float] = field(default_factory=dict)


def cluster_shape(run: OverlayRun) -> tuple[ClusterShape, dict[str, str]]:
    """The shape the schedule is drawn for, and its pod names -> the run's. A pod is named by its
    workload and its rank (``gateway-1``), not by its generated suffix, so that a seed draws the
    same schedule in every run."""
    nodes: dict[str, list[tuple[str, Role]]] = defaultdict(list)
    names: dict[str, str] = {}
    for owner, role in ROLES.items():
        for rank, pod in enumerate(run.pods_of(owner)):
            alias = f"{owner.split('/')[1]}-{rank}"
            names[alias] = pod.name
            nodes[f"node{pod.node}"].append((alias, role))
    return ClusterShape.of(dict(nodes)), names


class Readiness:
    """Each pod's readiness, polled in a thread: (time, {pod: ready}) samples."""

    def __init__(self, run: OverlayRun):
        self.run = run
        self.samples: list[tuple[float, dict[str, bool]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="nemesis-readiness", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), {s.name: s.ready for s in self.run.status()}))
            self._stop.wait(READINESS_POLL_S)

    def serving_at(self, pod: str, after: float) -> float | None:
        for at, ready in self.samples:
            if at >= after and ready.get(pod):
                return at
        return None


class LedgerWatch:
    """cluster_watch.py in an etcd pod's namespace; its JSONL read back as ledger snapshots."""

    def __init__(self, run: OverlayRun, out: Path):
        self.path = out / "loads.jsonl"
        self.workers = {p.name for p in run.pods_of("Deployment/gpu-worker")}
        """Only the workers' reports hold blocks (the other services report their own loads)."""
        etcd = run.pods_of("StatefulSet/etcd")[0]
        assert run.secrets is not None
        self._proc = subprocess.Popen(
            ["ip", "netns", "exec", run.netns_of(etcd.name), sys.executable, "-m", "bench.cluster.cluster_watch",
             "--endpoints", "127.0.0.1:2379", "--tls", *map(str, run.secrets.admin_files()), "--out", str(self.path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=(out / "cluster_watch.log").open("w"),
        )  # fmt: skip

    def lines(self) -> list[dict]:
        """Each read, with the workers' reports only."""
        if not self.path.exists():
            return []
        lines = [json.loads(line) for line in self.path.read_text().splitlines() if line.endswith("}")]
        return [
            {"at": line["at"], "loads": {w: r for w, r in line["loads"].items() if w in self.workers}}
            for line in lines
        ]

    def lenders(self) -> dict[str, int]:
        lines = self.lines()
        if not lines:
            return {}
        return {w: BlockReport.from_load(w, load).lent_total for w, load in lines[-1]["loads"].items()}

    def snapshots(self) -> list[LedgerSnapshot]:
        return [
            LedgerSnapshot(line["at"], tuple(BlockReport.from_load(w, load) for w, load in sorted(line["loads"].items())))
            for line in self.lines()
        ]  # fmt: skip

    def stop(self) -> None:
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def wait_for(condition, what: str, guard_s: float = HANG_GUARD_S, interval_s: float = 1.0) -> None:
    """Until ``condition()`` holds; a hang guard, not a deadline on the work."""
    end = time.monotonic() + guard_s
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"nemesis: {what} did not happen within the {guard_s:.0f} s hang guard")
        time.sleep(interval_s)


def leader_observations(run: OverlayRun) -> tuple[list[LeaderTerm], list[LeaderWrite]]:
    """Terms from the kv_managers' log lines, writes from the workers' (ts mapped onto the
    monotonic clock)."""
    offset = time.time() - time.monotonic()
    terms, writes = [], []
    for pod in run.pods_of("Deployment/kv-manager") + run.pods_of("Deployment/gpu-worker"):
        for container in run.containers.get(pod.name, []):
            if not container.log.exists():
                continue
            for line in container.log.read_text(errors="replace").splitlines():
                if not line.startswith("{"):
                    continue
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                msg, logger = entry.get("msg", ""), entry.get("logger", "")
                if logger not in ("loramesh.leader", "loramesh.leader_fence"):
                    continue
                at = datetime.datetime.fromisoformat(entry["ts"]).timestamp() - offset
                words = msg.split()
                if logger == "loramesh.leader" and " is now the leader of kv_manager (term " in msg:
                    terms.append(LeaderTerm(int(words[-1].rstrip(")")), words[0], at))
                elif logger == "loramesh.leader_fence" and msg.startswith("kv_manager write "):
                    # "kv_manager write WHAT from LEADER term N: accepted|refused (...)"
                    at_from = words.index("from")
                    writer, term = words[at_from + 1], int(words[at_from + 3].rstrip(":"))
                    accepted = words[at_from + 4] == "accepted"
                    writes.append(LeaderWrite(at, writer, term, accepted, " ".join(words[2:at_from])))
    return terms, writes


def first_ok_after(ops: Sequence[Op], moment: float) -> float | None:
    """When a client's operation first succeeded at or after ``moment`` (None: none did)."""
    done = [op.completed_at for op in ops if op.outcome == Outcome.OK and op.completed_at is not None
            and op.completed_at >= moment]  # fmt: skip
    return min(done) if done else None


def run_round(run: OverlayRun, config: NemesisConfig) -> RoundResult:
    """The round: schedule, load, faults, heals, observations, verdict (also written to
    ``config.out``)."""
    load_dir = config.out / "load"
    if load_dir.is_dir() and any(load_dir.iterdir()):
        # An earlier round's stop file would end this load at once, and its history would mix in.
        raise ValueError(f"{config.out} holds an earlier round's results: give the round another directory")
    config.out.mkdir(parents=True, exist_ok=True)
    load_dir.mkdir(exist_ok=True)
    shape, names = cluster_shape(run)
    schedule = fault_schedule(
        shape,
        ScheduleConfig(config.seed, config.duration_s, config.kinds, config.warmup_s, config.fault_s,
                       config.quiet_s, config.tail_s),
    )  # fmt: skip
    (config.out / "schedule.jsonl").write_text("".join(e.to_json() + "\n" for e in schedule))
    assert run.secrets is not None
    watch = LedgerWatch(run, config.out)
    executor = FaultExecutor(run, watch.lenders, names)
    load = subprocess.Popen(
        ["ip", "netns", "exec", run.netns_of(config.client), sys.executable, "-m", "bench.cluster.load",
         "--gateways", ",".join(gateway_addresses(run)), "--api-key", run.secrets.api_key,
         "--tls", *map(str, run.secrets.admin_files()), "--out", str(load_dir), "--seed", str(config.seed),
         *(["--deterministic"] if config.deterministic else [])],
        stdin=subprocess.DEVNULL, stdout=(config.out / "load.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    applied: list[tuple[float, float, Applied]] = []
    open_faults: dict[str, tuple[float, Applied]] = {}
    try:
        wait_for(lambda: (load_dir / "running").exists() or load.poll() is not None,
                 "the load's first operation", config.hang_guard_s, 0.2)  # fmt: skip
        if load.poll() is not None:
            raise RuntimeError(
                f"the load ended before its first operation (exit {load.returncode}): see {config.out / 'load.log'}"
            )
        with Readiness(run) as readiness:
            started = _play(executor, schedule, applied, open_faults, load)
            time.sleep(max(0.0, started + config.duration_s - time.monotonic()))  # the quiet tail
            guard = config.hang_guard_s
            wait_for(lambda: all(s.ready for s in run.status()), "every pod ready again", guard)
            (load_dir / "stop").touch()
            try:
                load.wait(guard)
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"nemesis: the load did not end within the {guard:.0f} s hang guard after its stop "
                    f"(an operation stuck past its deadline?): see {config.out / 'load.log'}"
                ) from None
            if load.returncode != 0:
                raise RuntimeError(f"the load failed (exit {load.returncode}): see {config.out / 'load.log'}")
            load_done = time.monotonic()
            wait_for(lambda: _loans_back(watch, load_done), "every loan back after the load", guard, 2.0)
        ops = History.read_jsonl(load_dir / "history.jsonl")
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
        watch.stop()
        for _, fault in open_faults.values():  # a fault left on by a failure must not outlive the round
            executor.heal(fault)
    heals = [
        Heal(a.fault.label, healed, {**{pod: readiness.serving_at(pod, healed) for pod in _affected(run, a)},
                                      "mesh (a client's operation)": first_ok_after(ops, healed)})
        for _, healed, a in applied if not a.skipped
    ]  # fmt: skip
    terms, writes = leader_observations(run)
    snapshots = watch.snapshots()
    references = json.loads((load_dir / "references.json").read_text())
    verdict = check(ops, read_store(load_dir / "store.json"), references, snapshots, terms, writes, heals,
                    config.heal_bound_s)  # fmt: skip
    most_lent = max((sum(r.lent_total for r in s.reports) for s in snapshots), default=0)
    result = RoundResult(verdict, ops, applied, heals, snapshots, most_lent=most_lent)
    result.report = round_report(result, started)
    (config.out / "faults.jsonl").write_text("".join(
        json.dumps({"started": at, "healed": healed, "skipped": a.skipped, **asdict(a.fault)}) + "\n"
        for at, healed, a in applied
    ))  # fmt: skip
    (config.out / "verdict.txt").write_text(result.report + "\n")
    return result


def _play(
    executor: FaultExecutor,
    schedule: Sequence[Event],
    applied: list,
    open_faults: dict,
    load: subprocess.Popen,
) -> float:
    """Each event at its time from now (``open_faults``: those started, not healed yet); returns
    when the round started (monotonic)."""
    started = time.monotonic()
    for event in schedule:
        time.sleep(max(0.0, started + event.at_s - time.monotonic()))
        if load.poll() is not None:
            raise RuntimeError(f"the load ended early (exit {load.returncode})")
        if event.action == "start":
            if event.fault.during == "borrowed-request":
                _wait_briefly(lambda: executor.lending_creditor() is not None, 10.0)
            open_faults[event.fault.id] = (time.monotonic(), executor.start(event.fault))
        else:
            at, fault = open_faults.pop(event.fault.id)
            executor.heal(fault)
            applied.append((at, time.monotonic(), fault))
    return started


def _wait_briefly(condition, seconds: float) -> None:
    """A fault that needs a condition waits a little for it (then goes on, skipped if unmet)."""
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.5)


def _loans_back(watch: LedgerWatch, after: float) -> bool:
    lines = [line for line in watch.lines() if line["at"] > after]
    if not lines:
        return False
    last = [BlockReport.from_load(w, load) for w, load in lines[-1]["loads"].items()]
    return all(not r.lent and not r.borrowed for r in last)


def _affected(run: OverlayRun, applied: Applied) -> list[str]:
    fault = applied.fault
    if fault.kind == NemesisKind.PARTITION:
        return list(fault.isolate)
    if fault.kind in (NemesisKind.KILL_POD, NemesisKind.KILL_NODE):
        return list(fault.pods)
    nodes = {int(n.removeprefix("node")) for n in fault.nodes}
    return [p.name for p in run.pods if p.node in nodes and p.owner in ROLES]


def round_report(result: RoundResult, started: float) -> str:
    """Per fault: ops invoked during it and after it (until the next) and how many succeeded,
    the slowest time to serving; then the checker's problems, and its summary line last."""
    lines = []
    ops = result.ops
    windows = sorted(result.applied, key=lambda x: x[0])
    for i, (at, healed, applied) in enumerate(windows):
        fault = applied.fault
        if applied.skipped:
            lines.append(f"{fault.label}: skipped ({applied.skipped})")
            continue
        after_end = windows[i + 1][0] if i + 1 < len(windows) else float("inf")
        during = [op for op in ops if at <= op.invoked_at < healed]
        after = [op for op in ops if healed <= op.invoked_at < after_end]
        heal = next(h for h in result.heals if h.fault == fault.label)
        took = [t - healed for t in heal.serving_at.values() if t is not None]
        lines.append(
            f"{fault.label} at {at - started:.1f} s for {healed - at:.1f} s: during {_availability(during)}, "
            f"after {_availability(after)}; serving again {max(took, default=0):.1f} s after the heal"
            + f"; {stalls_at(ops, [at]).describe()}"
        )
    for kind in (NemesisKind.KILL_NODE, NemesisKind.KILL_POD):
        kills = [at for at, _, a in windows if a.fault.kind == kind and not a.skipped]
        if kills:
            lines.append(f"failover after {kind} ({len(kills)}): {stalls_at(ops, kills).describe()}")
    lines.append(
        f"most KV blocks lent at once: {result.most_lent} ({result.verdict.borrowed_streams} borrowing streams)"
    )
    problems = result.verdict.report().splitlines()[1:]
    return "\n".join([*lines, *problems, result.verdict.summary])


def _availability(ops: Sequence[Op]) -> str:
    if not ops:
        return "no ops"
    ok = sum(op.outcome == Outcome.OK for op in ops)
    return f"{ok}/{len(ops)} ops ok ({100 * ok / len(ops):.0f}%)"
