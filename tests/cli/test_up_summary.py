"""What `loramesh up` says, once ready, about who may call what: without TLS that no RPC is
authorized and whether every port is on loopback; with TLS what a tenant and the operator present."""

from __future__ import annotations

import os

from loramesh_cli.mesh_commands import authorization_summary, print_summary
from loramesh_cli.mesh_file import MeshFile, ServiceEntry


def mesh_file(tls: dict[str, str] | None = None, host: str = "127.0.0.1") -> MeshFile:
    return MeshFile(
        up_pid=os.getpid(), etcd_endpoint=f"{host}:2379", etcd_pid=0, admin_api_key="k",
        services={
            "gateway": ServiceEntry(f"{host}:1", f"{host}:2", 1, "gateway.log", f"{host}:3"),
            "scheduler": ServiceEntry(f"{host}:4", f"{host}:5", 1, "scheduler.log"),
        },
        etcd=ServiceEntry(f"{host}:2379", "", 1, "etcd.log"),
        tls=tls or {},
    )  # fmt: skip


def test_without_tls_up_says_no_rpc_is_authorized_and_every_port_is_on_loopback(tmp_path, capsys):
    print_summary(mesh_file(), tmp_path)
    lines = capsys.readouterr().err.splitlines()
    assert (
        "no TLS: no RPC is authorized (the gateways check API keys, nothing else checks a caller); "
        "every port is on loopback (127.0.0.1): only this machine reaches them; "
        "`loramesh up --tls` for identities"
    ) in lines


def test_a_port_off_loopback_is_called_out():
    assert "NOT every port is on loopback" in authorization_summary(mesh_file(host="10.0.0.7"))


def test_with_tls_up_says_tenants_present_the_ca_alone_and_the_operator_its_certificate():
    tls = {"ca_file": "/s/certs/ca.pem", "cert_file": "/s/certs/operator.pem", "key_file": "/s/k.pem"}
    line = authorization_summary(mesh_file(tls))
    assert line.startswith("TLS: tenants (the SDK, `loramesh generate`) call the gateways with an API key")
    assert "the CA /s/certs/ca.pem only, no certificate" in line
    assert "operator RPCs and etcd take /s/certs/operator.pem" in line


def test_each_worker_says_what_it_runs(tmp_path, capsys):
    mesh = mesh_file()
    mesh.services["gpu_worker-0"] = ServiceEntry(
        "127.0.0.1:6", "127.0.0.1:7", 1, "w.log", runs="weights q4_1 (quantized blocks), activations bfloat16"
    )
    print_summary(mesh, tmp_path)
    lines = capsys.readouterr().err.splitlines()
    worker = next(i for i, line in enumerate(lines) if line.strip().startswith("gpu_worker-0"))
    assert lines[worker + 1].strip() == "weights q4_1 (quantized blocks), activations bfloat16"
    assert not any("weights" in line for line in lines[:worker])  # the other services run no model
