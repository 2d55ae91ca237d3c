"""The nemesis's fault schedule: from a seed, a duration, the kinds of fault wanted and the
cluster's shape (nodes and the pods on each, with their roles), a list of timed fault and heal
events. The same inputs give the same schedule, on any machine.

One fault at a time, Jepsen style: quiet, fault, heal, quiet... so each heal's time to serving
belongs to one fault. The scenarios (issue 49):

- partition: cut a minority of the etcd members off, then the etcd leader; isolate a worker from
  etcd, a gateway from the schedulers; isolate the creditor of a borrowed request while it runs;
- latency: 2–50 ms one way on the links between two nodes (the delaying proxy);
- loss: 5% of the packets between two nodes (nftables);
- kill-pod: one pod; kill-node: every pod of one node (healed: restarted).

Who leads etcd and which worker lends blocks are only known while the run goes on, so those
targets are symbols (:data:`ETCD_LEADER`, :data:`LENDING_CREDITOR`) the runner resolves when the
fault starts. Every scenario the shape allows comes once per round, in a seeded order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum

ETCD_LEADER = "@etcd-leader"
"""The etcd member leading when the fault starts."""
LENDING_CREDITOR = "@lending-creditor"
"""A worker holding KV blocks for a borrowed request in flight when the fault starts."""


class Role(StrEnum):
    """What a pod runs (the service names the mesh uses)."""

    ETCD = "etcd"
    WORKER = "gpu_worker"
    GATEWAY = "gateway"
    SCHEDULER = "scheduler"
    KV_MANAGER = "kv_manager"
    STORE = "adapter_store"


class NemesisKind(StrEnum):
    PARTITION = "partition"
    LATENCY = "latency"
    LOSS = "loss"
    KILL_POD = "kill-pod"
    KILL_NODE = "kill-node"


def parse_kinds(text: str) -> tuple[NemesisKind, ...]:
    """``partition,latency,...`` (the ``--nemesis`` flag) -> kinds; a clear error for others."""
    kinds = []
    for word in (w.strip() for w in text.split(",")):
        try:
            kinds.append(NemesisKind(word))
        except ValueError:
            known = ", ".join(k.value for k in NemesisKind)
            raise ValueError(f"unknown nemesis {word!r}: choose among {known}") from None
    return tuple(dict.fromkeys(kinds))


@dataclass(frozen=True)
class Pod:
    name: str
    role: Role
    node: str


@dataclass(frozen=True)
class ClusterShape:
    """The pods of the cluster, each on its node."""

    pods: tuple[Pod, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.pods]
        if len(set(names)) != len(names):
            raise ValueError(f"pod names repeat in the cluster shape: {sorted(names)}")
        object.__setattr__(self, "pods", tuple(sorted(self.pods, key=lambda p: p.name)))

    @classmethod
    def of(cls, nodes: dict[str, Iterable[tuple[str, Role | str]]]) -> ClusterShape:
        """From ``{node: [(pod name, role), ...]}``."""
        return cls(tuple(Pod(name, Role(role), node) for node, pods in nodes.items() for name, role in pods))

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({p.node for p in self.pods}))

    def named(self, role: Role) -> tuple[str, ...]:
        return tuple(p.name for p in self.pods if p.role == role)

    def on(self, node: str) -> tuple[str, ...]:
        return tuple(p.name for p in self.pods if p.node == node)


@dataclass(frozen=True)
class Fault:
    """One fault, from its start to its heal."""

    id: str
    """``f0``, ``f1``... in schedule order."""
    kind: NemesisKind
    scenario: str
    """Which of the kind's scenarios (``etcd-minority``, ``kill-node``...)."""
    isolate: tuple[str, ...] = ()
    """partition: the pods (or a symbol) cut off..."""
    from_pods: tuple[str, ...] = ()
    """...from these pods, both ways; empty: from every other pod."""
    nodes: tuple[str, ...] = ()
    """latency/loss: the links between these two nodes (both ways); kill-node: the node."""
    pods: tuple[str, ...] = ()
    """kill-pod/kill-node: the pods killed (restarted at the heal)."""
    delay_ms: float = 0.0
    """latency: added one way, on each direction of each link."""
    loss_percent: float = 0.0
    """loss: packets dropped on each direction of each link."""
    during: str = ""
    """A condition the runner waits for before starting the fault (``borrowed-request``: a
    request whose KV is lent by a creditor is in flight)."""

    @property
    def label(self) -> str:
        """How checks and logs name it: ``f3 partition/etcd-leader``."""
        return f"{self.id} {self.kind}/{self.scenario}"


@dataclass(frozen=True)
class Event:
    at_s: float
    """Seconds from the start of the run."""
    action: str
    """``start`` or ``heal``."""
    fault: Fault

    def to_json(self) -> str:
        return json.dumps({"at_s": self.at_s, "action": self.action, **asdict(self.fault)})


@dataclass(frozen=True)
class ScheduleConfig:
    """What to schedule, and the rhythm of it."""

    seed: int
    duration_s: float
    """The whole run; the last heal comes at least ``tail_s`` before its end."""
    kinds: tuple[NemesisKind, ...] = tuple(NemesisKind)
    warmup_s: float = 10.0
    """Quiet at the start: the clients get going, the undisturbed references are taken."""
    fault_s: tuple[float, float] = (5.0, 15.0)
    """Each fault lasts a duration drawn uniformly from this range."""
    quiet_s: tuple[float, float] = (5.0, 10.0)
    """The quiet between a heal and the next fault, drawn uniformly from this range."""
    tail_s: float = 15.0
    """Quiet at the end, so the final observations see a healed cluster."""
    delay_ms: tuple[float, float] = (2.0, 50.0)
    """Range of the one-way delay a latency fault adds."""
    loss_percent: float = 5.0


def fault_schedule(shape: ClusterShape, config: ScheduleConfig) -> tuple[Event, ...]:
    """The timed start and heal events of one run (sorted by time)."""
    rng = random.Random(config.seed)
    scenarios = _scenarios(shape, config.kinds)
    events: list[Event] = []
    t = config.warmup_s
    while True:
        for scenario in _round(scenarios, rng):
            length = rng.uniform(*config.fault_s)
            if t + length + config.tail_s > config.duration_s:
                if not events:
                    raise ValueError(
                        f"a run of {config.duration_s:g} s leaves no room for a fault: it needs "
                        f"{config.warmup_s:g} s of warm-up + {config.fault_s[0]:g} s or more of fault + "
                        f"{config.tail_s:g} s of tail"
                    )
                return tuple(events)
            fault = _fault(f"f{len(events) // 2}", scenario, shape, config, rng)
            events += [Event(round(t, 3), "start", fault), Event(round(t + length, 3), "heal", fault)]
            t += length + rng.uniform(*config.quiet_s)


def _scenarios(shape: ClusterShape, kinds: Sequence[NemesisKind]) -> list[tuple[NemesisKind, str]]:
    """The scenarios of ``kinds`` that ``shape`` has the pods for; every kind must have one."""
    etcd, workers = shape.named(Role.ETCD), shape.named(Role.WORKER)
    possible = {
        NemesisKind.PARTITION: [
            name
            for name, ok in (
                ("etcd-minority", len(etcd) >= 3),
                ("etcd-leader", len(etcd) >= 1),
                ("worker-from-etcd", bool(etcd and workers)),
                ("gateway-from-schedulers", bool(shape.named(Role.GATEWAY) and shape.named(Role.SCHEDULER))),
                ("creditor-mid-borrow", len(workers) >= 2),
            )
            if ok
        ],
        NemesisKind.LATENCY: ["latency"] if len(shape.nodes) >= 2 else [],
        NemesisKind.LOSS: ["loss"] if len(shape.nodes) >= 2 else [],
        NemesisKind.KILL_POD: ["kill-pod"] if shape.pods else [],
        NemesisKind.KILL_NODE: ["kill-node"] if len(shape.nodes) >= 2 else [],
    }
    if not kinds:
        raise ValueError("no nemesis kinds given: name at least one of " + ", ".join(NemesisKind))
    scenarios = []
    for kind in kinds:
        if not possible[kind]:
            raise ValueError(
                f"nemesis {kind} has nothing to act on in a cluster of {len(shape.nodes)} node(s) "
                f"and pods {[p.name for p in shape.pods]}"
            )
        scenarios += [(kind, name) for name in possible[kind]]
    return scenarios


def _round(scenarios: list[tuple[NemesisKind, str]], rng: random.Random) -> list[tuple[NemesisKind, str]]:
    """Every scenario once, shuffled; the etcd leader's cut comes right after the minority's."""
    order = [s for s in scenarios if s[1] != "etcd-leader"]
    rng.shuffle(order)
    leader = (NemesisKind.PARTITION, "etcd-leader")
    if leader in scenarios:
        minority = (NemesisKind.PARTITION, "etcd-minority")
        order.insert(
            order.index(minority) + 1 if minority in order else rng.randrange(len(order) + 1), leader
        )
    return order


def _fault(
    fault_id: str,
    scenario: tuple[NemesisKind, str],
    shape: ClusterShape,
    config: ScheduleConfig,
    rng: random.Random,
) -> Fault:
    kind, name = scenario
    base = Fault(fault_id, kind, name)
    etcd = shape.named(Role.ETCD)
    if name == "etcd-minority":
        return replace(base, isolate=tuple(sorted(rng.sample(etcd, (len(etcd) - 1) // 2))))
    if name == "etcd-leader":
        return replace(base, isolate=(ETCD_LEADER,))
    if name == "worker-from-etcd":
        return replace(base, isolate=(rng.choice(shape.named(Role.WORKER)),), from_pods=etcd)
    if name == "gateway-from-schedulers":
        return replace(
            base, isolate=(rng.choice(shape.named(Role.GATEWAY)),), from_pods=shape.named(Role.SCHEDULER)
        )
    if name == "creditor-mid-borrow":
        return replace(base, isolate=(LENDING_CREDITOR,), during="borrowed-request")
    if name == "latency":
        return replace(base, nodes=_two_nodes(shape, rng), delay_ms=round(rng.uniform(*config.delay_ms), 1))
    if name == "loss":
        return replace(base, nodes=_two_nodes(shape, rng), loss_percent=config.loss_percent)
    if name == "kill-pod":
        return replace(base, pods=(rng.choice(shape.pods).name,))
    node = rng.choice(shape.nodes)
    return replace(base, nodes=(node,), pods=shape.on(node))


def _two_nodes(shape: ClusterShape, rng: random.Random) -> tuple[str, ...]:
    return tuple(sorted(rng.sample(shape.nodes, 2)))
