"""The mesh's API for Python: the gRPC stubs generated from ``protos/loramesh/v1`` (in ``v1``).

Installed by both distributions (the SDK, ``loramesh-client``, and the servers, ``loramesh``), so
neither imports the other to speak the protocol. It imports nothing of the project's own.
"""
