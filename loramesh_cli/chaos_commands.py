"""``loramesh chaos``: kill -9 random processes of a supervised local mesh while greedy streams
keep flowing, and count what the clients saw.

Every prompt is first generated once undisturbed; that output is what every later request of the
same prompt must return, however many processes die under it. Kills are chosen and timed by a
:class:`KillPlan` (seeded RNG, injected clock), so a run's kill sequence is reproducible and the
plan is unit-tested without processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loramesh.errors import LoraMeshError
from loramesh_cli.errors import CommandError
from loramesh_cli.mesh_file import MeshFile, live_mesh, pid_alive

#: The supervisor's (and mesh.json's) name for etcd's process.
ETCD_PROCESS = "etcd"

PROMPTS = tuple(
    f"Write one sentence about {topic}."
    for topic in ("rivers", "owls", "bread", "trains", "snow", "maps", "bees", "glass",
                  "clocks", "salt", "kites", "moss", "ink", "wool", "caves", "lamps")
)  # fmt: skip
"""The requests sent round robin; greedy, so each has exactly one right answer."""

BACK_GUARD_S = 300.0
"""Not a timing claim: how long the end of a run waits for the killed processes to be up again
before reporting them as not back (a hang guard on a busy 2-core machine)."""


def process_kind(name: str) -> str:
    """``gateway-1`` -> ``gateway``, ``gpu_worker-0`` -> ``gpu_worker``, ``etcd`` -> ``etcd``."""
    return re.sub(r"-\d+$", "", name)


@dataclass(frozen=True)
class Kill:
    """One process killed by the plan."""

    name: str
    """Its name in mesh.json (also its etcd instance id)."""
    kind: str
    at_s: float
    """Seconds after the plan started."""


@dataclass
class KillPlan:
    """Which process to kill next and when: one kill every U[``min_interval_s``,
    ``max_interval_s``] seconds for ``duration_s`` seconds, victims drawn uniformly from the live
    processes. Pure bookkeeping: the clock and the seed are injected, nothing is killed here."""

    seed: int
    """Seeds the RNG that draws both the victims and the intervals."""
    min_interval_s: float = 5.0
    """Shortest wait between two kills."""
    max_interval_s: float = 10.0
    """Longest wait between two kills."""
    duration_s: float = 300.0
    """How long the plan runs from :meth:`start`; no kill is due after it."""
    clock: Callable[[], float] = time.monotonic
    """Seconds, monotonic (injected by tests)."""
    kills: list[Kill] = field(default_factory=list)
    """Every kill chosen so far, in order."""
    _rng: random.Random = field(init=False, repr=False)
    _started_at: float | None = field(default=None, init=False)
    _next_kill_at: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.min_interval_s <= self.max_interval_s:
            raise ValueError(
                f"kill interval must satisfy 0 < min <= max, got [{self.min_interval_s}, {self.max_interval_s}]"
            )
        if self.duration_s <= 0:
            raise ValueError(f"duration must be positive, got {self.duration_s}")
        self._rng = random.Random(self.seed)

    def start(self) -> None:
        """Start the duration; the first kill is one interval away."""
        self._started_at = self.clock()
        self._next_kill_at = self._started_at + self._interval()

    def elapsed_s(self) -> float:
        if self._started_at is None:
            raise RuntimeError("the kill plan has not started")
        return self.clock() - self._started_at

    def finished(self) -> bool:
        return self.elapsed_s() >= self.duration_s

    def seconds_until_next_kill(self) -> float:
        """Wait before the next kill, or before the end of the duration if that comes first."""
        end = self._started_at + self.duration_s if self._started_at is not None else 0.0
        return max(0.0, min(self._next_kill_at, end) - self.clock())

    def kill_due(self) -> bool:
        return not self.finished() and self.clock() >= self._next_kill_at

    def choose_victim(self, live: Sequence[str]) -> Kill | None:
        """Draw the next victim among ``live`` (order does not matter), record it and schedule
        the kill after it; None when nothing is alive to kill (the next try is one interval on)."""
        now = self.clock()
        self._next_kill_at = now + self._interval()
        if not live:
            return None
        name = self._rng.choice(sorted(live))
        kill = Kill(name=name, kind=process_kind(name), at_s=now - (self._started_at or now))
        self.kills.append(kill)
        return kill

    def kills_per_kind(self) -> dict[str, int]:
        return dict(sorted(Counter(k.kind for k in self.kills).items()))

    def _interval(self) -> float:
        return self._rng.uniform(self.min_interval_s, self.max_interval_s)


Output = tuple[tuple[int, ...], str]
"""A request's whole answer: its token ids and its text."""


@dataclass
class RequestTally:
    """What the chaos clients saw, request by request."""

    sent: int = 0
    identical: int = 0
    """Completed with exactly the undisturbed output."""
    different: int = 0
    """Completed with another output (a failover or continuation that changed the answer)."""
    lost: int = 0
    """Ended with an error after the SDK's retries."""
    first_errors: list[str] = field(default_factory=list)
    """The first few losses' messages, for the report."""
    first_differences: list[dict[str, str]] = field(default_factory=list)

    KEPT = 5

    @property
    def finished(self) -> int:
        return self.identical + self.different + self.lost

    def completed(self, prompt: str, expected: Output, got: Output) -> None:
        if got == expected:
            self.identical += 1
            return
        self.different += 1
        if len(self.first_differences) < self.KEPT:
            self.first_differences.append({"prompt": prompt, "expected": expected[1], "got": got[1]})

    def failed(self, error: Exception) -> None:
        self.lost += 1
        if len(self.first_errors) < self.KEPT:
            self.first_errors.append(str(error))


async def stream_output(sdk, prompt: str, max_tokens: int) -> Output:
    """One greedy streamed request, collected whole."""
    tokens: list[int] = []
    text = ""
    async for delta in sdk.stream(prompt, max_tokens=max_tokens, ignore_eos=True):
        tokens += delta.token_ids
        text += delta.text
    return tuple(tokens), text


async def reference_outputs(sdk, prompts: Sequence[str], max_tokens: int) -> dict[str, Output]:
    """Each prompt's undisturbed output (run before any kill)."""
    outputs = await asyncio.gather(*(stream_output(sdk, p, max_tokens) for p in prompts))
    return dict(zip(prompts, outputs))


class Traffic:
    """``concurrency`` clients sending the prompts round robin until :meth:`stop`, each answer
    checked against the reference."""

    def __init__(self, sdk, expected: dict[str, Output], concurrency: int, max_tokens: int):
        self.tally = RequestTally()
        self._sdk = sdk
        self._expected = expected
        self._prompts = list(expected)
        self._concurrency = concurrency
        self._max_tokens = max_tokens
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self._concurrency)]

    async def stop(self) -> RequestTally:
        """No new requests; waits for those in flight to end."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.tally

    async def _client(self, index: int) -> None:
        position = index
        while not self._stop.is_set():
            prompt = self._prompts[position % len(self._prompts)]
            position += self._concurrency
            self.tally.sent += 1
            try:
                got = await stream_output(self._sdk, prompt, self._max_tokens)
            except LoraMeshError as error:
                self.tally.failed(error)
            else:
                self.tally.completed(prompt, self._expected[prompt], got)


def live_processes(mesh: MeshFile) -> dict[str, int]:
    """Name -> pid of every process of the mesh running now, etcd included; never ``up`` itself
    (the supervisor)."""
    processes = {name: entry.pid for name, entry in mesh.services.items()}
    if mesh.etcd is not None:
        processes[ETCD_PROCESS] = mesh.etcd.pid
    return {name: pid for name, pid in processes.items() if pid > 0 and pid != mesh.up_pid and pid_alive(pid)}


def read_mesh(state_dir: Path) -> MeshFile:
    """The supervised mesh of ``state_dir``; a refusal naming its mesh.json when it is not up."""
    return live_mesh(state_dir)


def kill_one(state_dir: Path, plan: KillPlan) -> tuple[Kill, float] | None:
    """SIGKILL the plan's next victim; returns it and the Unix time just before the kill."""
    live = live_processes(read_mesh(state_dir))
    kill = plan.choose_victim(list(live))
    if kill is None:
        return None
    killed_unix = time.time()
    os.kill(live[kill.name], signal.SIGKILL)
    return kill, killed_unix


async def registered_since(mesh: MeshFile, name: str, since_unix: float) -> bool:
    """Whether ``name`` is back: etcd answering (for etcd), or the process registered in etcd by a
    run started after ``since_unix``."""
    from services.runtime.etcd.membership import MembershipConfig, list_members

    try:
        members = await list_members(
            MembershipConfig(etcd_endpoints=mesh.etcd_endpoint, tls=mesh.tls_config())
        )
    except Exception:  # noqa: BLE001 - etcd itself may be the one coming back
        return False
    if name == ETCD_PROCESS:
        return True
    return any(m.instance_id == name and m.started_at > since_unix for m in members)


def restarts_per_process(mesh: MeshFile) -> dict[str, int]:
    restarts = {name: entry.restarts for name, entry in mesh.services.items()}
    if mesh.etcd is not None:
        restarts[ETCD_PROCESS] = mesh.etcd.restarts
    return dict(sorted(restarts.items()))


def chaos_report(
    plan: KillPlan,
    tally: RequestTally,
    failovers: int,
    restarts_before: dict[str, int],
    restarts_after: dict[str, int],
    settings: dict[str, object],
) -> dict[str, object]:
    """The run's counts as one JSON-ready dict."""
    return {
        "settings": settings,
        "requests_sent": tally.sent,
        "completed_identical": tally.identical,
        "completed_different": tally.different,
        "lost": tally.lost,
        "sdk_failovers": failovers,
        "kills": len(plan.kills),
        "kills_per_kind": plan.kills_per_kind(),
        "kill_sequence": [{"process": k.name, "at_s": round(k.at_s, 1)} for k in plan.kills],
        "restarts_per_process": restarts_after,
        "restarts_during_run": {
            name: count - restarts_before.get(name, 0)
            for name, count in restarts_after.items()
            if count != restarts_before.get(name, 0)
        },
        "first_errors": tally.first_errors,
        "first_differences": tally.first_differences,
    }


def add_parsers(sub) -> None:
    chaos = sub.add_parser("chaos", help="kill -9 random processes of the local mesh under streamed load")
    chaos.add_argument("--duration", type=float, default=300.0, help="seconds of kills (default 300)")
    chaos.add_argument("--min-interval", type=float, default=5.0, help="shortest wait between kills (s)")
    chaos.add_argument("--max-interval", type=float, default=10.0, help="longest wait between kills (s)")
    chaos.add_argument("--seed", type=int, default=0, help="seeds the victims and intervals")
    chaos.add_argument("--concurrency", type=int, default=8, help="streams in flight at once")
    chaos.add_argument("--max-tokens", type=int, default=12, help="tokens per request")
    chaos.add_argument("--retries", type=int, default=30,
                       help="SDK retries per request (0.2 s doubling to 5 s: over a minute in all)")  # fmt: skip
    chaos.add_argument("--api-key", default="", metavar="KEY",
                       help="the tenant the load is sent as (default: $LORAMESH_API_KEY, else "
                            "mesh.json's admin key): a tenant with limits exercises the quotas")  # fmt: skip
    chaos.add_argument("--out", default="", help="also write the JSON report here")
    chaos.set_defaults(func=cmd_chaos)


def cmd_chaos(args) -> int:
    state_dir = Path(args.state_dir)
    for flag in ("concurrency", "max_tokens"):
        if getattr(args, flag) < 1:
            raise CommandError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    try:
        plan = KillPlan(args.seed, args.min_interval, args.max_interval, args.duration)
    except ValueError as error:
        raise CommandError(str(error)) from None
    read_mesh(state_dir)
    report = asyncio.run(_run_chaos(args, state_dir, plan))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if report["lost"] == 0 and report["completed_different"] == 0 else 1


async def _run_chaos(args, state_dir: Path, plan: KillPlan) -> dict[str, object]:
    from loramesh.async_client import AsyncClient
    from loramesh.client import RetryNotice
    from loramesh.errors import ResourceExhausted
    from loramesh_cli.gateway_client import API_KEY_ENV

    quota_retries: Counter[str] = Counter()
    """Retries after a tenant-quota refusal, by the limit that refused (gateway's message)."""

    def count_quota_retry(notice: RetryNotice) -> None:
        if isinstance(notice.failure, ResourceExhausted):
            limit = (
                "tokens_per_minute"
                if "tokens per minute" in str(notice.failure)
                else "max_concurrent_requests"
            )
            quota_retries[limit] += 1

    restarts_before = restarts_per_process(read_mesh(state_dir))
    async with AsyncClient(
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        mesh_file=MeshFile.path(state_dir),
        retries=args.retries,
        backoff_s=0.2,
        timeout=600,
        on_retry=count_quota_retry,
    ) as sdk:
        expected = await reference_outputs(sdk, PROMPTS, args.max_tokens)
        failovers_before = sdk.failovers
        quota_retries.clear()  # those of the reference outputs aside
        traffic = Traffic(sdk, expected, args.concurrency, args.max_tokens)
        traffic.start()
        plan.start()
        killed: list[tuple[str, float]] = []
        while not plan.finished():
            await asyncio.sleep(plan.seconds_until_next_kill())
            if plan.kill_due():
                done = kill_one(state_dir, plan)
                if done is not None:
                    killed.append((done[0].name, done[1]))
                    _log(f"{plan.elapsed_s():6.1f} s  kill -9 {done[0].name}  ({traffic.tally.sent} sent)")
        _log(f"{plan.elapsed_s():6.1f} s  no more kills; waiting for the requests in flight")
        tally = await traffic.stop()
        failovers = sdk.failovers - failovers_before
        quota_refusals = dict(sorted(quota_retries.items()))
    all_back = await _wait_all_back(state_dir, killed)
    settings = {
        "duration_s": args.duration, "interval_s": [args.min_interval, args.max_interval],
        "seed": args.seed, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "sdk_retries": args.retries, "all_killed_processes_back": all_back,
    }  # fmt: skip
    report = chaos_report(
        plan, tally, failovers, restarts_before, restarts_per_process(read_mesh(state_dir)), settings
    )
    report["quota_refusals_retried"] = sum(quota_refusals.values())
    report["quota_refusals_retried_per_limit"] = quota_refusals
    return report


async def _wait_all_back(state_dir: Path, killed: list[tuple[str, float]]) -> bool:
    """Whether every killed process registered again (the last kills may still be restarting)."""
    try:
        async with asyncio.timeout(BACK_GUARD_S):
            for name, killed_unix in killed:
                while not await registered_since(read_mesh(state_dir), name, killed_unix):
                    await asyncio.sleep(0.2)
    except TimeoutError:
        return False
    return True


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
