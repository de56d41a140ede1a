# Two entry points; each sets up (or reuses) the virtualenv first.
#   make demo   train a small Llama on the bundled corpus (emulated CPU cluster)
#   make test   run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test

setup:
	@VENV=$(VENV) bash scripts/setup_env.sh

demo: setup
	$(PY) -m megatron_het.demo $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)
