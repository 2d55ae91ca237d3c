"""How DistKV reaches other processes: the gRPC creditor transport, the same-host lending lane
(a Unix socket, or a creditor's pool mapped from shared memory) and its frames, and the
kv_manager client that suggests creditors. The domain beside it (``distkv/``) has no gRPC."""
