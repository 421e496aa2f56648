# pagedkv — build, test and run. `make test` works on a fresh clone: it sets up
# whatever is missing first.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp

# Each part is its own distribution holding a piece of the `pagedkv` namespace.
PARTS := shared services/scheduler services/router services/client services/gateway kernels services/executor bench
PART_FILES := $(foreach p,$(PARTS),$(p)/pyproject.toml)

PROTOS := $(wildcard protos/pagedkv/v1/*.proto)

.PHONY: setup test test-quick lint image-install-check proto run bench-blocks bench-host-tier bench-routing bench-cluster-sim bench-serve-cpu bench-serve-gpu bench-steps-cpu bench-memory bench-swap redis fuzz gpu-wheels clean

setup: $(STAMP)

# Says what it does before each step; pip shows what it collects, downloads
# (with a progress bar on a terminal) and installs.
$(STAMP): $(PART_FILES) constraints.txt requirements-dev.txt
	@if [ ! -x $(BIN)/python ]; then \
		echo "setup: creating the virtual environment $(VENV) with $(PYTHON)"; \
		$(PYTHON) -m venv $(VENV); \
	fi
	@echo "setup: installing pagedkv's parts (editable) and the dev tools into $(VENV);"
	@echo "setup: the first time, pip downloads torch, triton and transformers (minutes)"
	$(BIN)/pip install --progress-bar on -c constraints.txt -r requirements-dev.txt \
		$(foreach p,$(PARTS),-e ./$(p))
	@touch $@
	@echo "setup: done; $(VENV) is ready"

# Tests that need Redis start their own private server; this makes sure the
# binary is there.
redis:
	@command -v redis-server >/dev/null 2>&1 || \
		(apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

# Everything, the tests marked slow included (live clusters started, faulted
# and stopped many times, fuzzing, benchmark runs).
test: setup redis
	$(BIN)/python -m pytest

# The unit tests and the quick process tests (block core, kernels under the
# Triton interpreter, router, client and CLI, chart), none marked slow: about 2
# minutes on 2 quiet cores.
QUICK_TESTS := tests/scheduler tests/kernels tests/router tests/client tests/deploy tests/test_*.py
test-quick: setup redis
	$(BIN)/python -m pytest -m "not slow" $(QUICK_TESTS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint deploy/Dockerfile.scheduler deploy/Dockerfile.executor

# Runs the images' install steps (deploy/install.sh) in fresh temporary venvs,
# since no container daemon builds the images here: the scheduler set must
# give working `pagedkv scheduler`, `router` and `gateway` commands, import the
# gateway's app with its HTTP stack (FastAPI, uvicorn, Jinja2), list no command that
# needs the executor part (serve, executor, make-tiny-model) and hold neither
# torch nor transformers, the executor set a `pagedkv executor` command (torch
# as pip finds it: CPU here, CUDA in the image); neither holds the benchmarks
# (pagedkv.bench, the bench/ part).
image-install-check:
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	echo "image-install-check: the scheduler image's parts" && \
	PYTHON=$(PYTHON) sh deploy/install.sh scheduler "$$tmp/scheduler" >"$$tmp/scheduler.log" 2>&1 || \
		{ cat "$$tmp/scheduler.log"; exit 1; }; \
	"$$tmp/scheduler/bin/pagedkv" scheduler --help >/dev/null && \
	"$$tmp/scheduler/bin/pagedkv" router --help >/dev/null && \
	"$$tmp/scheduler/bin/pagedkv" gateway --help >/dev/null && \
	"$$tmp/scheduler/bin/python" -c "import fastapi, uvicorn, jinja2, pagedkv.gateway.app" && \
	if "$$tmp/scheduler/bin/pagedkv" --help | grep -Eq '^    (serve|executor|make-tiny-model) '; then \
		echo "image-install-check: the scheduler set lists commands it cannot run"; exit 1; fi && \
	for module in torch transformers pagedkv.bench; do \
		if "$$tmp/scheduler/bin/python" -c "import $$module" 2>/dev/null; then \
			echo "image-install-check: $$module is importable in the scheduler set"; exit 1; fi; \
	done && \
	echo "image-install-check: the executor image's parts" && \
	{ PYTHON=$(PYTHON) sh deploy/install.sh executor "$$tmp/executor" >"$$tmp/executor.log" 2>&1 || \
		{ cat "$$tmp/executor.log"; exit 1; }; } && \
	"$$tmp/executor/bin/pagedkv" executor --help >/dev/null && \
	"$$tmp/executor/bin/python" -c "import torch, triton, transformers, pagedkv.executor.server" && \
	if "$$tmp/executor/bin/python" -c "import pagedkv.bench" 2>/dev/null; then \
		echo "image-install-check: pagedkv.bench is importable in the executor set"; exit 1; fi && \
	echo "image-install-check: ok"

# Regenerates shared/pagedkv/v1 from protos/ (never edit the generated files).
proto: setup
	$(BIN)/python -m grpc_tools.protoc -Iprotos \
		--python_out=shared --pyi_out=shared --grpc_python_out=shared $(PROTOS)

# Starts `pagedkv serve` (2 CPU executors on a tiny random llama), streams a
# short workload through the SDK with progress bars, prints the final stats
# and stops the server (under a minute on a 2-core CPU).
run: setup
	$(BIN)/pagedkv demo

# Refreshes the committed block-core results.
bench-blocks: setup
	$(BIN)/pagedkv bench blocks --repeat 5 --output tests/benchmarks/results/blocks-cpu.json

# Refreshes the committed routing benchmarks (local CPU clusters, a fresh one
# per policy; some 15 minutes on 2 cores).
# The host tier's prefix hits on a trace 4x the GPU pool, through the real
# scheduler (a simulated executor; seconds).
bench-host-tier: setup
	$(BIN)/pagedkv bench host-tier --output tests/benchmarks/results/host-tier-cpu.json

bench-routing: setup redis
	$(BIN)/pagedkv bench routing --output tests/benchmarks/results/routing-cpu.json
	$(BIN)/pagedkv bench routing --num-blocks 384 --num-requests 512 \
		--output tests/benchmarks/results/routing-small-kv-cpu.json

# Refreshes the committed cluster simulations (64 executors x 8 schedulers,
# two traces; some 15 minutes on 2 cores).
bench-cluster-sim: setup
	$(BIN)/pagedkv bench cluster-sim --jobs 2 --output tests/benchmarks/results/cluster-sim-cpu.json
	$(BIN)/pagedkv bench cluster-sim --jobs 2 --num-prefixes 512 \
		--output tests/benchmarks/results/cluster-sim-512-prefixes-cpu.json

# The serving benchmark: a small run on the CPU (a tiny random llama, two
# rates, a 16 x (64 -> 32) batch against HF generate; about a minute) and a
# sweep of scheduler settings on one executor (half a minute), and
# the GPU recipe (on the GPU machine, after `make gpu-wheels` here: the ~1.1B
# llama, then the 8B shape; docs/benchmarks.md).
bench-serve-cpu: setup
	$(BIN)/pagedkv bench serve --rates 4,inf --num-requests 24 --mean-prompt-len 48 \
		--mean-output-len 24 --system-prompt-len 32 --fixed-batch 16x64x32 --num-blocks 512 \
		--output tests/benchmarks/results/serve-bench-cpu.json
	$(BIN)/pagedkv bench serve --sweep 1:2,4:2,8:2,8:3 --fixed-batch 16x64x32,64x64x32 \
		--warmup-requests 4 --mean-prompt-len 48 --mean-output-len 24 --system-prompt-len 32 \
		--num-blocks 1024 --output tests/benchmarks/results/serve-sweep-cpu.json

# The live scheduler's CPU per running request per decode step, without an
# executor, single steps and windows of 8 (docs/benchmarks.md; seconds).
bench-steps-cpu: setup
	{ $(BIN)/python -m pagedkv.bench.scheduler.steps --requests 64 256 && \
	  $(BIN)/python -m pagedkv.bench.scheduler.steps --requests 64 256 --decode-window 8 \
	  | tail -n +2; } > tests/benchmarks/results/scheduler-steps-cpu.txt
	$(BIN)/python -m pagedkv.bench.scheduler.tier_steps > tests/benchmarks/results/scheduler-tier-steps-cpu.txt

# KV memory, paged against contiguous, on the live CPU stack: the three
# scenarios of docs/memory.md (about five minutes on 2 cores).
bench-memory: setup
	$(BIN)/pagedkv bench memory --output tests/benchmarks/results/memory-cpu.json

# The memory benchmark's chat requests on half the blocks they need, without
# a host tier and per --host-loads mode, each twice (about a minute a mode).
bench-swap: setup
	$(BIN)/pagedkv bench swap --repeat 2 --output tests/benchmarks/results/swap-cpu.json

bench-serve-gpu:
	bash tests/gpu/run-serve-bench.sh 1b
	bash tests/gpu/run-serve-bench.sh 8b

# The stateful fuzz suite's long profile against the live stack (CI runs a
# short, derandomized one): PAGEDKV_FUZZ_EXAMPLES random bursts (default 300),
# failures kept in .hypothesis/ for replay.
fuzz: setup redis
	PAGEDKV_FUZZ_EXAMPLES=$${PAGEDKV_FUZZ_EXAMPLES:-300} $(BIN)/python -m pytest tests/service/test_fuzz.py

# Downloads into .whl/ the pinned wheels that a GPU machine without internet
# access lacks; there, `bash tests/gpu/run-gpu-tests.sh` runs the GPU tests.
gpu-wheels:
	PYTHON=$(PYTHON) bash tests/gpu/device-wheels.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
