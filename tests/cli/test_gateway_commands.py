"""The gateway-facing commands against a small fake gateway (grpc on loopback, in this process):
an empty ``adapters list`` says so, ``adapters upload`` checks the directory before sending
anything, a gateway that does not answer is retried with one stderr line per retry, and
``up --lora-modules`` registers, keeps or replaces adapters through the gateway with the owner's
key. The real gateway behind the same calls is tested in tests/cli/test_cli.py."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from support.gateway_server import serve_gateway

from loramesh.client import RetryNotice
from loramesh.errors import ResourceExhausted
from loramesh_cli.errors import CommandError
from loramesh_cli.gateway_client import announce_retry
from loramesh_cli.lora_modules import parse_lora_modules, register_lora_modules
from loramesh_cli.main import main
from mesh_api.v1 import adapter_store_pb2, gateway_pb2_grpc, types_pb2

KEYS = {"lm-admin": "admin", "lm-bob": "bob"}
"""The fake's API keys and their tenants."""


@dataclass
class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Adapters by (owner, name), the owner being the caller's tenant; records every upload."""

    adapters: dict[tuple[str, str], types_pb2.AdapterInfo] = field(default_factory=dict)
    uploads: list[tuple[str, str]] = field(default_factory=list)
    deletes: list[tuple[str, str]] = field(default_factory=list)
    imports: list[tuple[str, str, str]] = field(default_factory=list)
    generation_deadlines: list[float] = field(default_factory=list)
    """Each stream's deadline, on this process's monotonic clock (the CLI runs in it too)."""

    def _tenant(self, context) -> str:
        key = dict(context.invocation_metadata())["authorization"].removeprefix("Bearer ")
        if key not in KEYS:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        return KEYS[key]

    def UploadAdapter(self, request_iterator, context):
        tenant = self._tenant(context)
        header, files = None, {}
        for message in request_iterator:
            if message.HasField("header"):
                header = message.header
            else:
                files[message.chunk.filename] = files.get(message.chunk.filename, b"") + message.chunk.data
        if (tenant, header.name) in self.adapters:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"adapter {header.name!r} already exists")
        self.uploads.append((tenant, header.name))
        info = types_pb2.AdapterInfo(
            id=f"id-{len(self.uploads)}", name=header.name, owner=tenant, rank=8,
            sha256=hashlib.sha256(files["adapter_model.safetensors"]).hexdigest(),
            config_json=files["adapter_config.json"].decode(),
        )  # fmt: skip
        self.adapters[(tenant, header.name)] = info
        return adapter_store_pb2.RegisterAdapterResponse(adapter=info)

    def ImportAdapter(self, request, context):
        """A store that imports: a new name is imported, the same URI again changes nothing."""
        owned = (self._tenant(context), request.name)
        self.imports.append((*owned, request.uri))
        changed = owned not in self.adapters
        if changed:
            self.adapters[owned] = types_pb2.AdapterInfo(id=request.uri, name=request.name, owner=owned[0])
        return adapter_store_pb2.ImportAdapterResponse(adapter=self.adapters[owned], changed=changed)

    def ListAdapters(self, request, context):
        """Pages as the store does: a token is where the next page starts."""
        owned = [a for a in self.adapters.values() if a.owner == self._tenant(context)]
        start = int(request.page_token or 0)
        end = start + (request.page_size or 100)
        return adapter_store_pb2.ListAdaptersResponse(
            adapters=owned[start:end], next_page_token=str(end) if end < len(owned) else "", total=len(owned)
        )

    def GetAdapter(self, request, context):
        return self.adapters[(self._tenant(context), request.adapter)]

    def Generate(self, request, context):
        """Records the stream's deadline, and streams nothing."""
        self._tenant(context)
        # The time left first, the clock after: the sum is never below the deadline grpc holds
        # (read the other way round, it could fall short by the microseconds between the reads).
        remaining = context.time_remaining()
        self.generation_deadlines.append(time.monotonic() + remaining)
        return iter(())

    def DeleteAdapter(self, request, context):
        owned = (self._tenant(context), request.adapter)
        self.deletes.append(owned)
        return adapter_store_pb2.DeleteAdapterResponse(adapter=self.adapters.pop(owned))


@pytest.fixture
def gateway():
    """A fake gateway on a free loopback port; yields (its servicer, its address)."""
    servicer = FakeGateway()
    with serve_gateway(servicer) as address:
        yield servicer, address


def adapter_dir(path: Path, rank: int = 8) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    (path / "adapter_model.safetensors").write_bytes(bytes(range(64)) * rank)
    return path


def cli(tmp_path, gateway_address: str, *argv: str) -> int:
    return main(
        ["--state-dir", str(tmp_path / "state"), *argv, "--gateway", gateway_address, "--api-key", "lm-admin"]
    )


def test_an_empty_list_says_so(gateway, tmp_path, capsys):
    servicer, address = gateway
    assert cli(tmp_path, address, "adapters", "list") == 0
    assert capsys.readouterr().out == "no adapters: this tenant has none and no tenant has a public one\n"
    servicer.adapters[("admin", "x")] = types_pb2.AdapterInfo(name="x", owner="admin", id="i")
    assert cli(tmp_path, address, "adapters", "list") == 0
    assert capsys.readouterr().out.splitlines()[0].split()[:2] == ["NAME", "OWNER"]


def test_list_pages_with_a_page_size_and_says_the_next_token_on_stderr(gateway, tmp_path, capsys):
    servicer, address = gateway
    for name in ("a", "b", "c"):
        servicer.adapters[("admin", name)] = types_pb2.AdapterInfo(name=name, owner="admin", id=f"id-{name}")
    assert cli(tmp_path, address, "adapters", "list", "--page-size", "2") == 0
    first = capsys.readouterr()
    assert [line.split()[0] for line in first.out.splitlines()[1:]] == ["a", "b"]
    assert first.err.strip() == "2 of 3 adapters; next page: --page-token 2"
    assert cli(tmp_path, address, "adapters", "list", "--page-size", "2", "--page-token", "2") == 0
    last = capsys.readouterr()
    assert [line.split()[0] for line in last.out.splitlines()[1:]] == ["c"]
    assert last.err.strip() == "1 of 3 adapters; last page"
    assert cli(tmp_path, address, "adapters", "list") == 0  # no page size: every page
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: None, "adapter directory {d} does not exist"),
        (lambda d: d.write_text("not a directory"), "{d} is a file, not an adapter directory"),
        (lambda d: d.mkdir(), "adapter directory {d} has no adapter_config.json"),
        (lambda d: (adapter_dir(d), (d / "adapter_model.safetensors").unlink()),
         "adapter directory {d} has no adapter_model.safetensors"),
        (lambda d: (adapter_dir(d), (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")),
         "adapter directory {d} has no adapter_model.safetensors (adapter_model.bin is a pickle"),
    ],
)  # fmt: skip
def test_upload_checks_the_directory_before_sending_it(make, reason, gateway, tmp_path, capsys):
    servicer, address = gateway
    directory = tmp_path / "my-lora"
    make(directory)
    assert cli(tmp_path, address, "adapters", "upload", str(directory), "--name", "x") == 1
    assert capsys.readouterr().err.startswith("loramesh: " + reason.format(d=directory))
    assert servicer.uploads == []


def test_upload_sends_a_good_directory(gateway, tmp_path, capsys):
    servicer, address = gateway
    assert cli(tmp_path, address, "adapters", "upload", str(adapter_dir(tmp_path / "a")), "--name", "x") == 0
    assert capsys.readouterr().out.startswith("registered admin/x id=id-1 rank=8")
    assert servicer.uploads == [("admin", "x")]


def test_each_retry_of_an_unreachable_gateway_is_one_stderr_line(tmp_path, capsys):
    """Nothing listens on port 1 of loopback: every attempt is refused, and each retry says where
    it goes next (the gateways rotate)."""
    gateways = "127.0.0.1:1,127.0.0.1:2"
    status = main(["--state-dir", str(tmp_path), "generate", "--gateway", gateways, "--api-key", "k",
                   "--retries", "2", "hi"])  # fmt: skip
    lines = capsys.readouterr().err.splitlines()
    assert status == 1 and len(lines) == 3, lines
    assert lines[0].startswith("loramesh: gateway 127.0.0.1:1 is unavailable; retrying on 127.0.0.1:2 in ")
    assert lines[0].endswith(" s (retry 1 of 2)")
    assert lines[1].startswith("loramesh: gateway 127.0.0.1:2 is unavailable; retrying on 127.0.0.1:1 in ")
    assert lines[1].endswith(" s (retry 2 of 2)")
    assert lines[2].startswith("loramesh: UNAVAILABLE: ")


def test_a_quota_wait_is_announced_as_one_not_as_an_unavailable_gateway(capsys):
    refusal = ResourceExhausted("tenant 'bob' is over 2 concurrent requests", retry_after_s=0.5)
    announce_retry(RetryNotice("127.0.0.1:7", "127.0.0.1:7", 1, 3, 0.5, refusal))
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "loramesh: gateway 127.0.0.1:7 asked to wait (tenant 'bob' is over 2 concurrent requests); "
        "retrying on 127.0.0.1:7 in 0.5 s (retry 1 of 3)"
    )


def test_generate_gives_the_stream_the_timeout_asked_for(gateway, tmp_path, capsys):
    servicer, address = gateway
    spans = []
    for argv, asked in ((("--timeout", "300"), 300), ((), 60)):
        started = time.monotonic()
        assert cli(tmp_path, address, "generate", *argv, "hi") == 0
        spans.append((asked, started, time.monotonic()))
    # However long each command took, its deadline was set after it started and read before it
    # ended: at least `asked` after the start, at most `asked` (+1 s: grpc rounds up on the wire)
    # after the end.
    for (asked, started, ended), deadline in zip(spans, servicer.generation_deadlines, strict=True):
        assert deadline - started >= asked and deadline - ended <= asked + 1, (
            asked,
            started,
            ended,
            deadline,
        )
    assert cli(tmp_path, address, "generate", "--timeout", "0", "hi") == 1
    assert capsys.readouterr().err.endswith("loramesh: --timeout must be above 0, got 0\n")
    assert len(servicer.generation_deadlines) == 2


def test_retries_must_not_be_negative(tmp_path, capsys):
    assert (
        main(
            ["--state-dir", str(tmp_path), "adapters", "list", "--gateway", "127.0.0.1:1", "--retries", "-1"]
        )
        == 1
    )
    assert capsys.readouterr().err == "loramesh: --retries must be at least 0, got -1\n"


def test_lora_modules_are_registered_kept_or_replaced(gateway, tmp_path):
    servicer, address = gateway
    adapter_dir(tmp_path / "bot")
    adapter_dir(tmp_path / "bob-bot", rank=4)
    plain_keys = {"bob": "lm-bob"}
    modules = parse_lora_modules(
        [f"bot={tmp_path / 'bot'}", f"bob/bot={tmp_path / 'bob-bot'}"], "admin", plain_keys
    )
    keys = {**plain_keys, "admin": "lm-admin"}
    log: list[str] = []

    def register() -> None:
        register_lora_modules(modules, [address], keys, None, tmp_path / "mesh.json", log.append)

    register()
    assert servicer.uploads == [("admin", "bot"), ("bob", "bot")]  # each with its owner's key
    assert log == [
        f"registered admin/bot from {tmp_path / 'bot'}",
        f"registered bob/bot from {tmp_path / 'bob-bot'}",
    ]
    register()  # the store kept them (same state directory): nothing sent again
    assert len(servicer.uploads) == 2 and log[-1].startswith("kept (already registered, same files) bob/bot")
    adapter_dir(tmp_path / "bot", rank=16)  # the directory changed since
    register()
    assert servicer.deletes == [("admin", "bot")] and servicer.uploads[-1] == ("admin", "bot")
    assert log[-2] == f"replaced (its files changed) admin/bot from {tmp_path / 'bot'}"


def test_a_module_given_as_a_uri_is_imported_by_the_store(gateway, tmp_path):
    servicer, address = gateway
    modules = parse_lora_modules(["bot=hf://org/bot@v2", "bob/bot=s3://bucket/b"], "admin", {"bob": "lm-bob"})
    keys = {"bob": "lm-bob", "admin": "lm-admin"}
    log: list[str] = []
    for _ in range(2):
        register_lora_modules(modules, [address], keys, None, tmp_path / "mesh.json", log.append)
    assert servicer.imports == [("admin", "bot", "hf://org/bot@v2"), ("bob", "bot", "s3://bucket/b")] * 2
    assert servicer.uploads == []  # nothing read locally: the store fetched them
    assert log == [
        "imported admin/bot from hf://org/bot@v2",
        "imported bob/bot from s3://bucket/b",
        "kept (already imported, same content) admin/bot from hf://org/bot@v2",
        "kept (already imported, same content) bob/bot from s3://bucket/b",
    ]


def test_a_module_the_mesh_refuses_names_the_entry(gateway, tmp_path):
    _, address = gateway
    modules = parse_lora_modules([f"bot={adapter_dir(tmp_path / 'bot')}"], "admin", {})
    with pytest.raises(CommandError, match=r"^--lora-modules bot=.*/bot: UNAUTHENTICATED: invalid API key$"):
        register_lora_modules(modules, [address], {"admin": "lm-wrong"}, None, tmp_path / "mesh.json", print)
