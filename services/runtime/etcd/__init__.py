"""etcd, as every service uses it: membership under a lease and the load reports published with it
(membership, worker_load), finding another service's address (discovery), one active replica
among several (leader_election), a local etcd as a child process for ``loramesh up`` and the
tests (etcd_server), and etcd's own per-instance users, provisioned once or kept in step with
Kubernetes pods (etcd_rbac, etcd_rbac_sync)."""
