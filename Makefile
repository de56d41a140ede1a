# Two entry points; each sets up (or reuses) the virtualenv first.
#   make demo   train a small Llama on a packaged corpus (emulated CPU cluster)
#   make test   run the whole test suite
#   make test-fast  unit tests and in-process CLI checks (no slow or multi-process tests)
#   make test-gpu   the tests marked gpu, with the GPU visible (every other session hides it,
#                   since its tests fork workers: tests/conftest.py); make test runs it after the
#                   rest where torch is built for CUDA/ROCm
#   make gpu-check  the prepared GPU check (scripts/gpu_check.sh; GPU rows SKIP without one)
#   make lint       ruff (lint and format) and mypy; make test runs it first
#   make toolchains the device compilers the kernel compile tests use (hipcc from apt as root;
#                   make test runs it)
VENV ?= .venv
PY := $(VENV)/bin/python
# pytest-xdist workers, one thread each (TEST_WORKERS=0 runs the tests in one process).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist worksteal
# Bytecode caches on for the tests and the demo even where the environment turns them off:
# every process they start would otherwise compile (and, for tests, assertion-rewrite) the
# package, torch and the test modules again, seconds each (the set-up installs without
# compiling: each module is compiled once, when first imported).
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

.PHONY: setup demo lint toolchains test test-fast test-gpu gpu-check

setup:
	@VENV=$(VENV) bash scripts/setup_env.sh

demo: setup
	PYTHONDONTWRITEBYTECODE= $(PY) -m megatron_het.demo $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/mypy

toolchains:
	@bash scripts/setup_toolchains.sh

test: setup lint toolchains
	$(PYTEST) -q $(XDIST) $(PYTEST_ARGS)
	@if $(PY) -c "import sys, torch; sys.exit(not torch.backends.cuda.is_built())"; then \
		$(MAKE) --no-print-directory test-gpu; fi

# (pytest's status 5: PYTEST_ARGS selected no GPU test)
test-gpu: setup
	MEGATRON_HET_TEST_GPU=1 $(PYTEST) -q tests/gpu $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-fast: setup
	$(PYTEST) -q $(XDIST) -m "not slow and not distributed and not gpu" $(PYTEST_ARGS)

gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)
