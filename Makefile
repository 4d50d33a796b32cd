# The two commands of the quick start: `make demo` and `make test`.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: deps build demo test test-sanitize bench bench-torch fuzz install clean

deps:
	@bash scripts/install-deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	@if [ -x $(BUILD)/apps/attn ]; then $(BUILD)/apps/attn tour --heatmap $(BUILD)/attn-tour-heatmap.png; else $(BUILD)/examples/cat_example; fi

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# AddressSanitizer + UndefinedBehaviorSanitizer build of the test suite.
test-sanitize: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DATTN_SANITIZE=ON -DATTN_BUILD_BENCH=OFF $(CMAKE_FLAGS)
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

# Benchmarks (docs/fused.md): validate, then time every backend; writes $(BUILD)/bench.json.
BENCH_ARGS ?=
bench: build
	$(BUILD)/bench/attn-bench --json $(BUILD)/bench.json $(BENCH_ARGS)

# The same shapes against PyTorch's CPU scaled_dot_product_attention (if installed).
bench-torch: build
	python3 bench/compare_torch.py --attn-bench $(BUILD)/bench/attn-bench $(BENCH_ARGS)

# libFuzzer targets for the .npy and safetensors parsers, FUZZ_SECONDS each
# (needs clang: scripts/install-fuzz-deps.sh).
FUZZ_SECONDS ?= 60
fuzz:
	bash scripts/install-fuzz-deps.sh
	bash scripts/fuzz.sh $(FUZZ_SECONDS)

install: build
	cmake --install $(BUILD) --prefix $(or $(PREFIX),/usr/local)

clean:
	rm -rf build build-asan build-werror build-fuzz
