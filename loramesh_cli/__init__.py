"""The ``loramesh`` command: runs a local mesh (``up``, ``down``, ``status``), talks to a gateway
like any client (``generate``, ``chat``, ``adapters``), and drives the development tools
(``bench``, ``chaos``, ``certs``). It ships with the servers' distribution, not the SDK's."""
