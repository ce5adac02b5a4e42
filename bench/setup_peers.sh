#!/usr/bin/env bash
# The benchmark peers, in a venv of their own (never a dependency of the service):
# llama-cpp-python, compiled from source (about 15 minutes on 2 cores). Run it in the
# background early:  bash bench/setup_peers.sh &   Then:  python -m bench.engine_bench --peers
set -euo pipefail
VENV=${PEERS_VENV:-.venv-peers}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-llama-cpp-python==0.3.36}
test -d "$VENV" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q pip==26.3
# native CPU code (AVX2/FMA on this host), OpenMP threads as llama.cpp ships them
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$VENV/bin/python" -m pip install -q \
    --no-cache-dir "$LLAMA_CPP_PYTHON" numpy
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
