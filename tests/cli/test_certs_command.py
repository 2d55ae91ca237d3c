"""``loramesh certs``: a CA and one certificate per identity, each naming its identity, keys 0600;
one bound to an instance on request."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from loramesh_cli.main import main
from services.runtime.security.certificates import CertificateDirectory
from services.runtime.security.identity import KINDS


def test_certs_writes_a_ca_and_one_certificate_per_identity(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out)]) == 0
    assert str(out / "gateway.pem") in capsys.readouterr().out
    certs = CertificateDirectory(out)
    assert certs.complete()
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    ca = x509.load_pem_x509_certificate(certs.ca_file.read_bytes())
    for identity in KINDS:
        assert stat.S_IMODE(certs.key_file(identity).stat().st_mode) == 0o600
        cert = x509.load_pem_x509_certificate(certs.cert_file(identity).read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == identity
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [f"spiffe://loramesh/{identity}"]
        assert {"localhost", "mesh.loramesh"} <= set(sans.get_values_for_type(x509.DNSName))
    store_names = x509.load_pem_x509_certificate(certs.cert_file("adapter_store").read_bytes())
    dns = store_names.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "adapter-store.loramesh.svc" in dns.get_values_for_type(x509.DNSName)

    # Again, for one identity: the CA is kept, so peers holding the old certificates still trust it.
    assert main(["certs", "--out", str(out), "--identity", "gpu_worker"]) == 0
    again = x509.load_pem_x509_certificate(certs.cert_file("gpu_worker").read_bytes())
    again.verify_directly_issued_by(ca)
    assert CertificateDirectory(out).ca_file.read_bytes() == certs.ca_file.read_bytes()


def test_certs_issues_a_certificate_bound_to_one_instance(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--identity", "gpu_worker/gpu_worker-0"]) == 0
    certs = CertificateDirectory(out)
    path = certs.cert_file("gpu_worker/gpu_worker-0")
    assert path == out / "gpu_worker" / "gpu_worker-0.pem" and str(path) in capsys.readouterr().out
    assert stat.S_IMODE((out / "gpu_worker").stat().st_mode) == 0o700
    assert stat.S_IMODE(certs.key_file("gpu_worker/gpu_worker-0").stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu_worker/gpu_worker-0"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    assert uris == ["spiffe://loramesh/gpu_worker/gpu_worker-0"]


@pytest.mark.parametrize("bad", ["nobody", "gpu_worker/a/b", "gpu_worker/..", "gpu_worker/"])
def test_certs_refuses_an_identity_it_does_not_know(tmp_path, capsys, bad):
    with pytest.raises(SystemExit):
        main(["certs", "--out", str(tmp_path / "certs"), "--identity", bad])
    assert "--identity" in capsys.readouterr().err
