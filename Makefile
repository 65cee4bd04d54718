# The whole set-up on a fresh machine:  `make run`  (start pdserve + kvstore on the built-in tiny model)
#                                        `make test` (run the test suite)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup run test lint fmt stubs clean

setup: $(VENV)/.installed

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
	# build the batch-invariant attention kernel once, up front (cached; without a compiler
	# the engine falls back to the torch path and tests/unit/test_fixed_kernel.py skips)
	-$(PY) -c "from pdserve.model.attention import fixed_kernel as k; raise SystemExit(not k.available())"
	# and, on a CPU with AMX, the batch-invariant bf16 linear (pdserve.model.amx_linear)
	-$(PY) -c "from pdserve.model import amx_linear as k; k.available()"
	# and, on a CPU with AVX512-BF16 and no AMX, its bf16 linear (pdserve.model.avx512_bf16_linear)
	-$(PY) -c "from pdserve.model import amx_linear as a, avx512_bf16_linear as k; a.cpu_has_amx() or k.available()"
	# and, on a CPU with AVX-512, the fused bf16 pointwise ops (pdserve.model.pointwise)
	-$(PY) -c "from pdserve.model import pointwise as k; k.load()"
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
