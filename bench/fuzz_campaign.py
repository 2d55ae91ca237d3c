"""A fuzz campaign over every entry point of the mesh, each called as every identity.

The mesh runs as real processes with mutual TLS (bench/fuzz/mesh.py). Then, derandomized (the
same inputs on every run of the same size):

- **HTTP**: every operation of the OpenAPI document the gateway's OpenAI port serves (the
  OpenAI, vLLM and LoRAX routes), schemathesis' cases that fit the schema and cases that break
  it, as tenant alice, tenant bob, with no key and with a garbage key;
- **gRPC**: every method of every service on every port (the gateway's public port; the
  adapter store, scheduler, kv_manager and worker's internal ports; health and reflection on
  each), with requests hypothesis builds from the method's descriptor
  (bench/fuzz/proto_messages.py) and raw or corrupted bytes: on the public port as the four
  tenants' identities above, on an internal port as every identity the mesh issues and as a
  caller with no certificate;
- **hostile adapters** (bench/fuzz/hostile_adapters.py): uploaded through the gateway as each
  tenant identity (then chatted with, where the upload was taken), and loaded by path
  (``POST /v1/load_lora_adapter``, and ``ImportAdapter`` with a ``file://`` URI).

Counted: per entry point and identity, every outcome; as failures, HTTP 5xx and gRPC UNKNOWN,
INTERNAL and DATA_LOSS; at the end, the services whose process exited, and the stretches in
which a service's event loop answered no health check for over a second (bench/fuzz/loop_lag.py).
Run: ``python -m bench.fuzz_campaign --examples 200``; docs/security.md, "Fuzz campaign",
has a run's totals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import requests
import schemathesis
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2  # noqa: F401  (its descriptors in the pool)
from grpc_reflection.v1alpha import reflection_pb2  # noqa: F401  (its descriptors in the pool)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from bench.fuzz import hostile_adapters
from bench.fuzz.grpc_calls import UNCLEAR, call
from bench.fuzz.loop_lag import CONTROL, IdleControl, LagProbe, Stretch, split_by_control, stretch_lines
from bench.fuzz.mesh import TENANT_KEYS, FuzzMesh, start_fuzz_mesh
from bench.fuzz.proto_messages import Vocabulary, messages, raw_requests
from bench.fuzz.totals import Totals
from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import upload_requests
from mesh_api.v1 import (  # noqa: F401  (their descriptors in the pool)
    adapter_store_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    kv_manager_pb2,
    scheduler_pb2,
    types_pb2,
    worker_pb2,
)
from services.model_files.base_model import load_base_model_spec
from services.runtime.security.identity import KINDS

ALICE, BOB = (f"Bearer {key}" for key in TENANT_KEYS)
TENANTS = {
    "tenant alice": ALICE,
    "tenant bob": BOB,
    "no key": None,
    "garbage key": "Bearer lm-0000000000000000-not-a-key",
}
"""The public ports' identities: ``authorization`` metadata (None: none sent)."""
NO_CERTIFICATE = "no certificate"
MESH_IDENTITIES = (*(k for k in KINDS if k != "etcd"), NO_CERTIFICATE)
"""The internal ports' identities: every kind the mesh issues a client certificate to, and a
caller that presents none (its handshake fails: UNAVAILABLE)."""
SERVICES = {
    "gateway": ("loramesh.v1.Gateway",),
    "adapter_store": ("loramesh.v1.AdapterStore",),
    "scheduler": ("loramesh.v1.Scheduler",),
    "kv_manager": ("loramesh.v1.KVManager",),
    "gpu_worker": ("loramesh.v1.Worker",),
}
"""The services each process serves besides health and reflection."""
COMMON = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")
NO_WORKER = "no gpu_worker is live"
"""The gateway's 503 when no worker is registered: the answer expected of a mesh run without one."""
OWN, SHARED, HIDDEN = "alice-own", "bob-shared", "bob-hidden"
NAMES = st.sampled_from(
    ["", OWN, f"alice/{OWN}", f"bob/{SHARED}", f"bob/{HIDDEN}", HIDDEN, "nope", "bob/", "/", "alice", "bob",
     "worker-0", "loramesh.v1.Gateway", "a" * 300]
)  # fmt: skip
VOCABULARY = Vocabulary(names=NAMES)
MAX_GENERATED = 4
"""Tokens an HTTP case may have generated (see :func:`_short`)."""
FUZZ = settings(
    derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck), print_blob=False
)
"""Every generated run: the same examples on every run, no example database, no deadline."""


@dataclass(frozen=True)
class CampaignConfig:
    """The campaign's size."""

    examples: int = 50
    """Generated requests per (gRPC method, identity), and schemathesis cases per (HTTP operation,
    mode, identity)."""
    raw_examples: int = 15
    """Raw or corrupted serialized requests per (gRPC method, identity)."""
    worker: bool = True
    """Run a worker on the real model (its port fuzzed, and generation reaching it); False: no
    worker, quicker to start (the gateway's generation calls end UNAVAILABLE: no worker)."""
    adapters: bool = True
    """Send the hostile adapters."""
    call_timeout_s: float = 30.0
    """Not a timing claim: a call unanswered this long counts as DEADLINE_EXCEEDED."""
    only: tuple[str, ...] = ()
    """Run only the parts named (``http``, ``grpc``, ``adapters``); empty: all."""


@dataclass
class CampaignResult:
    totals: Totals
    dead: list[str]
    """Services whose process exited during the campaign."""
    lag: dict
    """Service -> LagCounts of the loop-lag probe."""
    stretches: list[Stretch]
    """The probe's blocked stretches."""
    seconds: float

    @property
    def failures(self) -> int:
        return sum(self.totals.failed.values())

    @property
    def blocked(self) -> int:
        """Stretches in a service's loop alone (not seen on the idle control at the same time)."""
        return len(split_by_control(self.stretches)[0])

    @property
    def machine_stalls(self) -> int:
        """Stretches seen on the idle control too: the machine's or the prober's, not a loop's."""
        return len(split_by_control(self.stretches)[1])


def _credentials(mesh: FuzzMesh, identity: str) -> grpc.ChannelCredentials:
    ca = mesh.certs.ca_file.read_bytes()
    if identity == NO_CERTIFICATE:
        return grpc.ssl_channel_credentials(ca)
    tls = mesh.certs.tls_for(identity)
    return grpc.ssl_channel_credentials(ca, Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())


class Channels:
    """One TLS channel per (service, identity), closed together."""

    def __init__(self, mesh: FuzzMesh):
        self.mesh = mesh
        self._open: dict[tuple[str, str], grpc.Channel] = {}

    def get(self, service: str, identity: str) -> grpc.Channel:
        if (service, identity) not in self._open:
            address = self.mesh.processes[service].address
            public = service == "gateway" and identity in TENANTS
            credentials = (
                grpc.ssl_channel_credentials(self.mesh.certs.ca_file.read_bytes())
                if public
                else _credentials(self.mesh, identity)
            )
            self._open[service, identity] = grpc.secure_channel(address, credentials)
        return self._open[service, identity]

    def close(self) -> None:
        for channel in self._open.values():
            channel.close()


def _methods(names: tuple[str, ...]) -> list[MethodDescriptor]:
    pool = descriptor_pool.Default()
    return [m for name in names for m in pool.FindServiceByName(name).methods]


def fuzz_grpc(channels: Channels, totals: Totals, config: CampaignConfig, service: str) -> None:
    """Every method of ``service``'s port as each of its identities."""
    identities = TENANTS if service == "gateway" else {i: None for i in MESH_IDENTITIES}
    for method in _methods((*SERVICES[service], *COMMON)):
        entry = f"gRPC {service} {method.containing_service.name}/{method.name}"
        for identity, key in identities.items():
            channel = channels.get(service, identity)
            metadata = () if key is None else (("authorization", key),)
            _fuzz_method(channel, totals, config, method, entry, identity, metadata)


def _fuzz_method(
    channel, totals: Totals, config: CampaignConfig, method, entry: str, identity: str, metadata
) -> None:
    def one(serialized: list[bytes], kind: str) -> None:
        code, details, _ = call(channel, method, serialized, metadata, config.call_timeout_s)
        failure = None
        if code in UNCLEAR:
            failure = f"{code.name} {details[:300]!r} ({kind}: {b''.join(serialized)[:200]!r})"
        totals.add(entry, identity, code.name, failure)

    count = st.integers(0, 3) if method.client_streaming else st.just(1)

    @settings(FUZZ, max_examples=config.examples)
    @given(st.lists(messages(method.input_type, VOCABULARY), min_size=1, max_size=3), count)
    def structured(requests_, how_many):
        one([m.SerializeToString() for m in requests_][:how_many] or [b""], "message")

    @settings(FUZZ, max_examples=config.raw_examples)
    @given(raw_requests(method.input_type, VOCABULARY))
    def raw(request_bytes):
        one([request_bytes], "bytes")

    structured()
    raw()


# -- HTTP ------------------------------------------------------------------------------------


def _real_names(case, data) -> None:
    """Point some cases at real models, so they get past the model lookup."""
    if isinstance(case.body, dict) and data.draw(st.booleans(), label="real model"):
        if "inputs" in case.body:
            if not isinstance(case.body.get("parameters"), dict):
                case.body["parameters"] = {}
            case.body["parameters"]["adapter_id"] = data.draw(NAMES)
        else:
            case.body["model"] = data.draw(NAMES)
    if case.path_parameters and "model" in case.path_parameters and data.draw(st.booleans()):
        case.path_parameters["model"] = data.draw(NAMES)


def _short(case, mode: GenerationMode) -> None:
    """Cap how many tokens a case may generate at :data:`MAX_GENERATED` where it says nothing
    else (a case that fits the schema: where it says more): the campaign fuzzes input handling,
    and a case that has the worker generate its whole context on a CPU would take the run's time
    without reaching any more code."""
    body = case.body
    if not isinstance(body, dict):
        return
    if "inputs" in body:
        if not isinstance(body.get("parameters"), dict):
            body["parameters"] = {}
        body = body["parameters"]
        keys = ("max_new_tokens",)
    elif "messages" in body or "prompt" in body:
        keys = ("max_tokens", "max_completion_tokens")
    else:
        return
    for key in keys:
        value = body.get(key)
        if key not in body or (
            mode == GenerationMode.POSITIVE and isinstance(value, int) and value > MAX_GENERATED
        ):
            body[key] = MAX_GENERATED


def fuzz_http(mesh: FuzzMesh, totals: Totals, config: CampaignConfig) -> None:
    verify = str(mesh.certs.ca_file)
    with requests.Session() as session:
        session.trust_env = False  # REQUESTS_CA_BUNDLE would replace the mesh's CA
        session.verify = verify
        document = session.get(f"{mesh.openai_url}/openapi.json", timeout=config.call_timeout_s).json()
        schema = schemathesis.openapi.from_dict(document)
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                for identity, key in TENANTS.items():
                    _fuzz_operation(mesh, session, totals, config, operation, mode, identity, key)


def _fuzz_operation(
    mesh, session, totals: Totals, config: CampaignConfig, operation, mode, identity, key
) -> None:
    entry = f"HTTP {operation.label}"

    @settings(FUZZ, max_examples=config.examples)
    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    def fuzz(case, data):
        _real_names(case, data)
        _short(case, mode)
        case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        if key is not None:
            case.headers["Authorization"] = key
        try:
            reply = case.call(
                base_url=mesh.openai_url,
                session=session,
                timeout=config.call_timeout_s,
                verify=session.verify,
            )
        except requests.exceptions.InvalidHeader:
            totals.add(entry, identity, "refused by the client")
            return
        except requests.ConnectionError as error:
            totals.add(entry, identity, "connection error", f"connection error: {error}"[:300])
            return
        except requests.Timeout:
            totals.add(entry, identity, "timeout")
            return
        failure = None
        if reply.status_code == 503 and not config.worker and NO_WORKER in reply.text:
            totals.add(entry, identity, "503 (no worker runs)")
            return
        if reply.status_code >= 500:
            body = reply.request.body
            failure = f"{reply.status_code} {reply.content[:300]!r} ({reply.request.method} {reply.request.url} {body!r:.300})"
        totals.add(entry, identity, reply.status_code, failure)

    try:
        fuzz()
    except Unsatisfiable:  # a negative mode for an operation with nothing to break (no body, no parameter)
        pass


# -- hostile adapters ------------------------------------------------------------------------


def _valid_files(root: Path) -> dict[str, bytes]:
    return adapter_files(
        write_peft_adapter(root / "valid", load_base_model_spec(), SampleAdapterSpec(rank=8))
    )


def _register_tenants(channels: Channels, files: dict[str, bytes], timeout_s: float) -> None:
    stub = gateway_pb2_grpc.GatewayStub(channels.get("gateway", "tenant alice"))
    for key, name, visibility in (
        (ALICE, OWN, types_pb2.VISIBILITY_PRIVATE),
        (BOB, SHARED, types_pb2.VISIBILITY_PUBLIC),
        (BOB, HIDDEN, types_pb2.VISIBILITY_PRIVATE),
    ):
        stub.UploadAdapter(
            upload_requests(files, name, owner="", visibility=visibility),
            metadata=(("authorization", key),),
            timeout=timeout_s,
        )


def _grpc_outcome(
    totals: Totals, entry: str, identity: str, label: str, rpc: Callable, *args, **kwargs
) -> bool:
    """Call ``rpc(*args, **kwargs)`` (a stream's replies read to its end); count its outcome
    under ``entry``; whether it was OK. ``label``: the input, named in a failure."""
    try:
        reply = rpc(*args, **kwargs)
        if not hasattr(reply, "SerializeToString"):
            list(reply)
    except grpc.RpcError as error:
        code = error.code()
        failure = f"{code.name} {(error.details() or '')[:300]!r} ({label})" if code in UNCLEAR else None
        totals.add(entry, identity, code.name, failure)
        totals.notes.append(f"{entry} [{identity}] {label}: {code.name} {(error.details() or '')[:160]}")
        return False
    totals.add(entry, identity, "OK")
    totals.notes.append(f"{entry} [{identity}] {label}: OK")
    return True


UPLOAD = "adapter upload (gRPC UploadAdapter)"
CHAT = "chat with a hostile adapter (gRPC Chat)"
DELETE = "delete a hostile adapter (gRPC DeleteAdapter)"
PATH_LOAD = "adapter path load (HTTP load_lora_adapter)"
IMPORT = "adapter import (gRPC ImportAdapter file://)"


def fuzz_adapters(
    mesh: FuzzMesh, channels: Channels, totals: Totals, config: CampaignConfig, valid: dict[str, bytes]
) -> None:
    """Every hostile adapter uploaded, and every hostile tree loaded by path, as each tenant identity."""
    uploads = hostile_adapters.uploads(valid)
    trees = hostile_adapters.trees(mesh.load_dir / "hostile", valid)
    for identity, key in TENANTS.items():
        stub = gateway_pb2_grpc.GatewayStub(channels.get("gateway", identity))
        metadata = () if key is None else (("authorization", key),)
        for i, (label, files) in enumerate(uploads.items()):
            _upload_and_chat(totals, config, stub, identity, metadata, f"hostile-{i}", label, files)
        for i, (label, path) in enumerate(trees.items()):
            _load_by_path(mesh, totals, config, identity, key, f"loaded-{i}", label, path)
            request = adapter_store_pb2.ImportAdapterRequest(uri=path.as_uri(), name=f"imported-{i}")
            timeout = config.call_timeout_s
            _grpc_outcome(
                totals,
                IMPORT,
                identity,
                label,
                stub.ImportAdapter,
                request,
                metadata=metadata,
                timeout=timeout,
            )


def _upload_and_chat(
    totals: Totals,
    config: CampaignConfig,
    stub,
    identity: str,
    metadata,
    name: str,
    label: str,
    files: dict[str, bytes],
) -> None:
    """Upload ``files`` as ``name``; where it is taken, chat with it, then delete it."""
    timeout = config.call_timeout_s
    upload = upload_requests(files, name, owner="")
    if not _grpc_outcome(
        totals, UPLOAD, identity, label, stub.UploadAdapter, upload, metadata=metadata, timeout=timeout
    ):
        return
    chat = gateway_pb2.ChatRequest(
        adapter=name,
        messages=[gateway_pb2.ChatMessage(role="user", content="Hi")],
        sampling=types_pb2.SamplingParams(max_tokens=2),
    )
    _grpc_outcome(totals, CHAT, identity, label, stub.Chat, chat, metadata=metadata, timeout=timeout)
    delete = gateway_pb2.GatewayAdapterRequest(adapter=name)
    _grpc_outcome(
        totals, DELETE, identity, label, stub.DeleteAdapter, delete, metadata=metadata, timeout=timeout
    )


def _load_by_path(
    mesh: FuzzMesh,
    totals: Totals,
    config: CampaignConfig,
    identity: str,
    key: str | None,
    name: str,
    label: str,
    path: Path,
) -> None:
    """``POST /v1/load_lora_adapter`` of ``path`` as ``name``; unloaded again where it was taken."""
    headers = {} if key is None else {"authorization": key}
    verify = str(mesh.certs.ca_file)
    try:
        reply = requests.post(
            f"{mesh.openai_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
            headers=headers, verify=verify, timeout=config.call_timeout_s,
        )  # fmt: skip
    except requests.Timeout:
        totals.add(PATH_LOAD, identity, "timeout", f"timeout ({label})")
        return
    failure = f"{reply.status_code} {reply.text[:300]!r} ({label})" if reply.status_code >= 500 else None
    totals.add(PATH_LOAD, identity, reply.status_code, failure)
    totals.notes.append(f"{PATH_LOAD} [{identity}] {label}: {reply.status_code} {reply.text[:160]}")
    if reply.status_code == 200:
        requests.post(
            f"{mesh.openai_url}/v1/unload_lora_adapter", json={"lora_name": name},
            headers=headers, verify=verify, timeout=config.call_timeout_s,
        )  # fmt: skip


# -- the run -----------------------------------------------------------------------------------


async def _start(root: Path, config: CampaignConfig) -> FuzzMesh:
    return await start_fuzz_mesh(root, worker=config.worker)


def run_campaign(
    root: Path, config: CampaignConfig, progress: Callable[[str], None] = lambda line: None
) -> CampaignResult:
    """Start the mesh under ``root``, run every part, stop it; the totals."""
    parts = set(config.only or ("http", "grpc", "adapters"))
    with IdleControl() as control:
        mesh = asyncio.run(_start(root, config))
        channels = Channels(mesh)
        totals = Totals()
        began = time.monotonic()
        targets = {name: channels.get(name, "operator") for name in mesh.processes}
        targets[CONTROL] = control.channel
        probe = LagProbe(targets, doing=lambda: totals.last or "setup").start()
        try:
            valid = _valid_files(root)
            _register_tenants(channels, valid, config.call_timeout_s)
            if "grpc" in parts:
                for service in mesh.processes:
                    fuzz_grpc(channels, totals, config, service)
                    progress(f"gRPC {service}: {totals.cases} cases so far")
            if "http" in parts:
                fuzz_http(mesh, totals, config)
                progress(f"HTTP: {totals.cases} cases so far")
            if "adapters" in parts and config.adapters:
                fuzz_adapters(mesh, channels, totals, config, valid)
                progress(f"hostile adapters: {totals.cases} cases so far")
            lag = probe.stop()
            return CampaignResult(totals, mesh.dead(), lag, probe.stretches, time.monotonic() - began)
        finally:
            probe.stop()
            channels.close()
            mesh.stop()


def port(entry: str) -> str:
    """An entry point's group in the summary: its port (``gRPC adapter_store``, ``HTTP``), or
    itself (the hostile adapters' steps)."""
    if entry.startswith("gRPC "):
        return " ".join(entry.split()[:2])
    if entry.startswith("HTTP "):
        return "HTTP (OpenAI, vLLM, LoRAX routes)"
    return entry


def report(result: CampaignResult) -> list[str]:
    summary = (
        f"{result.totals.cases} cases in {result.seconds:.0f} s; {result.failures} × 5xx / INTERNAL / UNKNOWN / DATA_LOSS; "
        f"{len(result.dead)} crashed processes {result.dead}; {result.blocked} blocked event loops "
        f"({result.machine_stalls} stalls seen on the idle control too: the machine's)"
    )
    lines = [
        summary,
        "",
        *result.totals.table(port),
        "",
        *result.totals.table(),
        "",
        "| service | health checks | blocked (> 1 s) | slowest check |",
        "|---|---:|---:|---:|",
    ]
    for name, counts in sorted(result.lag.items()):
        lines.append(f"| {name} | {counts.checks} | {counts.blocked} | {counts.worst_s:.3f} s |")
    own, machine = split_by_control(result.stretches)
    if own:
        lines += ["", "Blocked stretches:", *stretch_lines(own)]
    if machine:
        lines += ["", "Stalls seen on the idle control too (the machine's):", *stretch_lines(machine)]
    failures = result.totals.failure_lines()
    if failures:
        lines += ["", "Failures:", *failures]
    return lines


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=CampaignConfig.examples)
    parser.add_argument("--raw-examples", type=int, default=CampaignConfig.raw_examples)
    parser.add_argument("--no-worker", action="store_true", help="run no worker (no model loaded)")
    parser.add_argument("--only", action="append", choices=["http", "grpc", "adapters"], default=[])
    parser.add_argument("--json", type=Path, help="also write the totals here")
    args = parser.parse_args(argv)
    config = CampaignConfig(
        examples=args.examples,
        raw_examples=args.raw_examples,
        worker=not args.no_worker,
        only=tuple(args.only),
    )
    with tempfile.TemporaryDirectory(prefix="loramesh-fuzz-") as root:
        result = run_campaign(
            Path(root), config, progress=lambda line: print(line, file=sys.stderr, flush=True)
        )
    print(f"CPU: {_cpu_model()}; {config}")
    print("\n".join(report(result)))
    if args.json:
        args.json.write_text(json.dumps({
            "cases": result.totals.cases, "seconds": result.seconds, "dead": result.dead,
            "outcomes": {f"{e} [{i}]": dict(c) for (e, i), c in result.totals.outcomes.items()},
            "failures": result.totals.failure_lines(),
            "notes": result.totals.notes,
            "lag": {n: vars(c) for n, c in result.lag.items()},
            "stretches": stretch_lines(split_by_control(result.stretches)[0]),
            "machine_stalls": stretch_lines(split_by_control(result.stretches)[1]),
        }, indent=1))  # fmt: skip
    return 1 if result.failures or result.dead or result.blocked else 0


if __name__ == "__main__":
    sys.exit(main())
