"""The release of loramesh: the one place its version is written.

It lives in ``mesh_api`` because both distributions install this package and it imports nothing
of the project's own: the servers' distribution (``pyproject.toml``) and the client SDK's
(``sdk/pyproject.toml``) take their version from here at build time, and ``loramesh --version``,
``loramesh.__version__``, the gateway's ``GET /version`` and OpenAPI description, and the version
each service registers in etcd all read it.
"""

VERSION = "0.1.0"
"""The release, as PEP 440 spells it; CHANGELOG.md has an entry for it."""
