#!/usr/bin/env bash
# Remakes the converted test models and their llama.cpp references (never in CI; torch is a tool for
# making test data here, not a dependency): tiny HF checkpoints (make.py, torch 2.13.0 + transformers
# 5.25.0), llama.cpp's convert_hf_to_gguf.py from llama-cpp-python 0.3.36's sdist (convert.py, with
# that tree's pinned transformers 4.57.6), then llama.cpp's outputs (record.py, the shared build).
#   bash tests/parity/hf/rebuild.sh [name ...]
set -euo pipefail
cd "$(dirname "$0")/../../.."
T=${TOOLS:-/tmp/hearthlm-convert}; mkdir -p "$T"
if [ ! -d "$T/llama_cpp_python-0.3.36" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$T"
  tar xzf "$T/llama_cpp_python-0.3.36.tar.gz" -C "$T"
fi
LCPP="$T/llama_cpp_python-0.3.36/vendor/llama.cpp"
[ -x "$T/mk/bin/python" ] || { python3 -m venv "$T/mk"; "$T/mk/bin/pip" install -q torch==2.13.0 transformers==5.25.0 \
  safetensors tokenizers sentencepiece protobuf numpy; }
[ -x "$T/conv/bin/python" ] || { python3 -m venv "$T/conv"; "$T/conv/bin/pip" install -q torch==2.13.0 'numpy~=2.2.6' \
  'sentencepiece>=0.1.98,<0.3.0' transformers==4.57.6 'protobuf>=4.21.0,<5.0.0' safetensors "$LCPP/gguf-py"; }
LCP_PY=$(bash ../shared/tools/llama-cpp-build.sh)
rm -rf "$T/hf"
"$T/mk/bin/python" tests/parity/hf/make.py "$T/hf" "$@"
"$T/conv/bin/python" tests/parity/hf/convert.py --llama-cpp "$LCPP" "$T/hf" "$@"
"$LCP_PY" tests/parity/hf/record.py "$@"
