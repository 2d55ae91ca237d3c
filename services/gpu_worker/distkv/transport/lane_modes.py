"""The lending lane's modes (``--lending-lane``), apart from the lane itself so that configs and
the CLI can name them without importing torch."""

LANE_MODES = ("shared-memory", "socket", "tcp", "off")
"""``--lending-lane``, each the first lane a debtor tries, falling to the next it cannot reach:
the creditor's pool mapped (calls on the Unix socket for the rest; same host), every call on
the Unix socket (same host), every call on the TCP lane (between hosts; on one host too with
``tcp``), or no lane (every lending call over gRPC)."""
