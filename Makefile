# moetrain: `make demo` and `make test` are the two set-up commands; each creates .venv when it is
# missing, installs the pinned torch, builds the C++ extension (ninja caches objects in build/temp)
# and then runs. A second run skips every step whose inputs did not change.

PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
DEPS := setuptools>=77 wheel ninja pybind11 pytest pytest-timeout pytest-xdist ruff import-linter numpy pyyaml pillow sacrebleu>=2.6 transformers>=5
DEPS_STAMP := $(VENV)/.deps-$(shell printf '%s' '$(TORCH) $(DEPS)' | md5sum | cut -c1-12)
BUILD_STAMP := $(VENV)/.moetrain-built
SOURCES := setup.py pyproject.toml moetrain/_source_hash.py moetrain/_build_spec.py $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu csrc/*.cuh)
PYTEST_ARGS ?=

.PHONY: demo test test-extended test-floor test-benchmarks gpu-check lint bench build clean

demo: build
	$(PY) scripts/demo.py

# Two passes: the tests that time real waits or rates (marker `serial`) run alone after the others,
# which run on TEST_WORKERS processes (a test file stays on one worker; the longest files start
# first, tests/conftest.py). More workers than cores does not pay: with 3 on these 2 cores the
# first pass took as long as with 2, the cores busy 98% of the time. Each worker computes on one
# thread: with two threads each, every OpenMP region waits for a core the other worker holds (the
# layer, kernel, machinery and planner tests took 219-247 s that way, 144-154 s on one thread).
# Exit code 5 (a pass that PYTEST_ARGS left without tests) is not a failure. The first pass lists
# its 30 slowest tests, so a CI log shows where the suite's time goes.
TEST_WORKERS ?= 2
test: build lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 -m 'not build and not serial and not benchmarks and not extended' $(PYTEST_ARGS) || [ $$? -eq 5 ]
	OMP_NUM_THREADS=2 $(PY) -m pytest -m 'serial and not build and not benchmarks and not extended' $(PYTEST_ARGS) || [ $$? -eq 5 ]

# CI's benchmark step: every script under benchmarks/ run at its smallest settings (exit code, the
# first line it prints, its --json keys), two at a time; measuring is benchmarks/'s job, not this.
test-benchmarks: build
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --durations=10 -m 'benchmarks and not build' $(PYTEST_ARGS) || [ $$? -eq 5 ]

# CI's long checks (marker `extended`), after make test: the demo config's accuracy on a second seed
# (make test trains it on one: 2 ranks for about 2 minutes per seed on 2 cores).
test-extended: build
	OMP_NUM_THREADS=1 $(PY) -m pytest --durations=10 -m 'extended and not build' $(PYTEST_ARGS) || [ $$? -eq 5 ]

# CI's second leg: the floor of the supported torch range (a CUDA build of torch 2.11, as the CUDA
# images ship it), the extension compiled and linked with nvcc, imported, and the kernel, layer,
# optimizer, engine and just-in-time-build tests under it (scripts/ci_torch_floor.sh).
TORCH_FLOOR ?= torch==2.11.0
test-floor:
	bash scripts/ci_torch_floor.sh '$(TORCH_FLOOR)'

# On a machine with an NVIDIA GPU: build, GPU tests, GPU benchmarks and training smokes, one JSON
# and one log under runs/gpu_check/ (docs/gpu.md).
gpu-check:
	bash scripts/gpu_check.sh

lint: $(DEPS_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

bench: build
	$(PY) benchmarks/moe_layer.py --json benchmarks/moe_layer.json
	$(PY) benchmarks/cpu_adam.py --json benchmarks/cpu_adam.json
	$(PY) benchmarks/all_to_all.py --json benchmarks/all_to_all.json
	$(PY) benchmarks/node_limited.py --json benchmarks/node_limited.json
	$(PY) benchmarks/moe_layer_ep.py --json benchmarks/moe_layer_ep.json
	$(PY) benchmarks/compile.py --json benchmarks/compile.json
	$(PY) benchmarks/grouped_mm.py --json benchmarks/grouped_mm.json
	$(PY) benchmarks/checkpoint_stall.py --json benchmarks/checkpoint_stall.json
	$(PY) benchmarks/log_every.py --json benchmarks/log_every.json
	$(PY) benchmarks/decode.py --json benchmarks/decode.json
	$(PY) benchmarks/parallelize_classifier.py --json benchmarks/parallelize_classifier.json
	$(PY) benchmarks/m6_data.py workers --json benchmarks/m6_data_workers.json
	$(PY) benchmarks/m6_data.py index --json benchmarks/m6_data_index.json
	$(PY) benchmarks/pipeline_bubble.py --json benchmarks/pipeline_bubble.json

build: $(BUILD_STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): | $(VENV)/bin/python
	$(PIP) install --quiet '$(TORCH)' $(foreach dep,$(DEPS),'$(dep)')
	rm -f $(VENV)/.deps-* $(BUILD_STAMP)
	touch $@

$(BUILD_STAMP): $(DEPS_STAMP) $(SOURCES)
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $@

clean:
	rm -rf build moetrain/_C*.so $(BUILD_STAMP)
