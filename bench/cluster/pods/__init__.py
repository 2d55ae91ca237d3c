"""The k8s overlay run pod by pod on one machine (test support, never a product package).

``k8s/overlays/cpu`` is rendered by kubectl's built-in kustomize and every replica of every
Deployment and StatefulSet runs as a process in its own network namespace, on one of a few
"nodes" (a bridge each, joined by a fabric), with the manifest's own command, env, volumes,
probes and NetworkPolicies (as nftables rules). :class:`bench.cluster.pods.runner.OverlayRun`
is the entry point; ``python -m bench.cluster.pods`` keeps one up for a human.
docs/operations.md, "Running the overlay in network namespaces".
"""
