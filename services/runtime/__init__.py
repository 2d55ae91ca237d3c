"""What every service shares, grouped by concern (one line per subpackage):

- etcd/: membership and load reports under a lease, discovery, leader election, a local etcd
  server, etcd's per-instance users (provisioned once, or kept in step with Kubernetes pods).
- security/: mutual TLS, the mesh CA and its certificates, rotation without a restart, peer
  identities, the authorization table, the instance a call acts for, owner-only files.
- rpc/: the grpc.aio server bootstrap, the interceptor (request ids, authorization, domain errors
  to status codes), servicers with the service's own request readers.
- sampling/: what a generation request asks for (sampling parameters, their proto, the request
  checks, stop strings in a bounded window), read the same by the gateway and the workers.
- process/: child service processes, TCP ports for a later bind, the allocator and garbage
  collector settings, background tasks that always stop.

Used by every layer, at the top level: config (typed flags and environment), errors (domain
errors; no gRPC), logs, metrics (registry and the HTTP side port), capped_labels (per-adapter
label values capped for Prometheus), eviction (the caches' eviction policies).
"""
