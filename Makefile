# The two set-up commands from the README. Each creates .venv, installs the pinned torch and deps,
# builds fastdist's extension against that torch, then runs.
#   make bench [ARGS="collectives --ranks 4 --net 1gbit"]    runs fastdist-bench
#   make test  [PYTEST_ARGS="-k bitpack"]                     runs the test suite
# and for the torch-free kernel layer:
#   make kernel-check                                         C++ kernel tests (GoogleTest) + nvcc compile check
#   make sanitize-check                                       the same C++ tests under ASan + UBSan
#   make cuda-glue-check                                      nvcc compile check of the CUDA glue (csrc/ops/*_cuda.cu)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BUILD_INPUTS := $(shell find csrc -type f) setup.py pyproject.toml
CMAKE_DIR := build/cmake
SANITIZE_DIR := build/sanitize

.PHONY: bench test kernel-check sanitize-check cuda-glue-check env clean docs

$(VENV)/.deps: requirements-dev.txt requirements-nodeps.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-deps --no-build-isolation -r requirements-nodeps.txt
	touch $@

$(VENV)/.built: $(VENV)/.deps $(BUILD_INPUTS)
	MAX_JOBS=$$(nproc) $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) -m fastdist.env
	touch $@

bench: $(VENV)/.built
	$(VENV)/bin/fastdist-bench $(ARGS)

test: $(VENV)/.built
	$(PY) -m pytest $(PYTEST_ARGS)

env: $(VENV)/.built
	$(PY) -m fastdist.env

# docs/*.md's result tables, regenerated from bench/*.json (tests/test_docs.py fails when they are stale)
docs: $(VENV)/.built
	$(PY) -m fastdist.bench.results bench docs

kernel-check:
	cmake -S . -B $(CMAKE_DIR) -DCMAKE_BUILD_TYPE=Release
	cmake --build $(CMAKE_DIR) -j$$(nproc)
	ctest --test-dir $(CMAKE_DIR) --output-on-failure
	@if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then \
	  cmake --build $(CMAKE_DIR) --target cuda_compile_check; \
	else echo "kernel-check: no nvcc on this machine; CUDA compile check skipped"; fi

# The CPU kernels and their C++ tests (csrc/tests/test_fuzz.cpp's randomized cases among them) built with
# AddressSanitizer and UndefinedBehaviorSanitizer: any report fails the test that made it.
sanitize-check:
	cmake -S . -B $(SANITIZE_DIR) -DCMAKE_BUILD_TYPE=Debug -DFASTDIST_SANITIZE=ON
	cmake --build $(SANITIZE_DIR) -j$$(nproc) --target fastdist_kernel_tests
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --test-dir $(SANITIZE_DIR) --output-on-failure -j$$(nproc)

cuda-glue-check: $(VENV)/.deps
	scripts/cuda-glue-check.sh $(PY)

clean:
	rm -rf build dist $(VENV) python/fastdist/_C*.so python/fastdist/_build_info.py
