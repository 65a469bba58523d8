# Inferno: `make up` sets up a virtual environment and runs the whole stack; `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
ARGS ?=

.PHONY: setup up test bench-engine clean

setup: $(VENV)/.installed

# On a machine without an NVIDIA GPU, the CPU build of torch goes in first, so nothing that
# depends on torch pulls the multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install "torch==2.13.0"; fi
	$(PIP) install -e ".[test,bench]"
	@# A GPU host compiles the demo's kernels now, not at its first start (docs/operations.md, Triton's cache).
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(VENV)/bin/inferno warm-kernels --model-dir "$$($(VENV)/bin/inferno fetch-demo)" --device cuda \
	    || echo "make setup: warm-kernels failed; the kernels compile at the first start instead"; fi
	touch $@

up: setup
	$(VENV)/bin/inferno up $(ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15 tests $(ARGS)

bench-engine: setup
	$(VENV)/bin/inferno bench-engine $(ARGS)

clean:
	rm -rf $(VENV) models/demo
