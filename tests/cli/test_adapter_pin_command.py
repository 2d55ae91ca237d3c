"""`loramesh adapters pin NAME` and `unpin NAME` through the SDK's sync client, against a small
fake gateway (grpc on loopback, in this process) that records the SetAdapterPinned calls. The real
gateway and store behind the same call: tests/gateway/test_adapter_pin_grpc.py."""

from __future__ import annotations

import grpc
import pytest
from support.gateway_server import serve_gateway

from loramesh_cli.main import main
from mesh_api.v1 import adapter_store_pb2, gateway_pb2_grpc, types_pb2


class PinningGateway(gateway_pb2_grpc.GatewayServicer):
    """Admin's adapter ``bot``, pinned or not as the last call said."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.bot = types_pb2.AdapterInfo(id="id-bot", name="bot", owner="admin", size_bytes=64)

    def SetAdapterPinned(self, request, context):
        self.calls.append((request.adapter, request.pinned))
        if request.adapter != "bot":
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"adapter {request.adapter!r} of owner 'admin' not found"
            )
        self.bot.pinned = request.pinned
        return adapter_store_pb2.SetAdapterPinnedResponse(adapter=self.bot)


@pytest.fixture
def gateway():
    servicer = PinningGateway()
    with serve_gateway(servicer) as address:
        yield servicer, address


def test_pin_and_unpin_an_adapter(gateway, tmp_path, capsys):
    servicer, address = gateway
    flags = ["--gateway", address, "--api-key", "lm-admin"]
    assert main(["--state-dir", str(tmp_path), "adapters", "pin", "bot", *flags]) == 0
    assert capsys.readouterr().out == "pinned admin/bot id=id-bot 64 bytes\n"
    assert main(["--state-dir", str(tmp_path), "adapters", "unpin", "bot", *flags]) == 0
    assert capsys.readouterr().out == "unpinned admin/bot id=id-bot 64 bytes\n"
    assert servicer.calls == [("bot", True), ("bot", False)]
    assert main(["--state-dir", str(tmp_path), "adapters", "pin", "gone", *flags]) == 1
    assert "loramesh: NOT_FOUND: adapter 'gone' of owner 'admin' not found" in capsys.readouterr().err
