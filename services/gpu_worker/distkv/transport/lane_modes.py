"""The same-host lending lane's modes (``--lending-lane``), apart from the lane itself so that
configs and the CLI can name them without importing torch."""

LANE_MODES = ("shared-memory", "socket", "off")
"""``--lending-lane``: the pool mapped (calls on the socket for the rest), every call on the
socket, or no lane (gRPC)."""
