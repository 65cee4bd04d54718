# The whole set-up on a fresh machine:  `make run`  (start pdserve + kvstore on the built-in tiny model)
#                                        `make test` (run the test suite)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup run test lint fmt stubs clean

# setup = the venv, then the C++ kernels (cached; without a compiler each is named with the
# fallback that runs instead, and setup still succeeds)
setup: $(VENV)/.installed
	$(VENV)/bin/pdserve kernels build

$(VENV)/.installed: pyproject.toml services/*/pyproject.toml
	python3 -m venv $(VENV)
	# torch 2.13.0: the CPU build lies on local disk; a bare `torch` would pull CUDA.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[engine,ucx,bench,dev,replicas]'
	$(PIP) install -q -e services/router -e services/prefill -e services/decode -e services/kvstore
	touch $@

# The whole local deployment: kvstore + router (gRPC :50051, OpenAI HTTP :8000) + workers on
# the built-in tiny model (random weights: gibberish replies). The banner prints commands
# that work as shown; ARGS passes more flags, e.g. make run ARGS="--model DIR --api-key KEY".
run: setup
	$(VENV)/bin/pdserve up $(ARGS)

test: setup
	# the tests also run the other ISA builds this CPU can run (e.g. the attention kernel's
	# fp32-math build); a kernel that is not built skips its tests, naming why
	$(VENV)/bin/pdserve kernels build --all
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

stubs: setup
	$(PY) -m pdserve.rpc.codegen

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
