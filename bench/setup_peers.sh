#!/usr/bin/env bash
# The benchmark peers, in a venv of their own (never a dependency of the service):
# llama-cpp-python, compiled from source (about 15 minutes on 2 cores). Run it in the
# background early:  bash bench/setup_peers.sh &   Then:  python -m bench.engine_bench --peers
set -euo pipefail
VENV=${PEERS_VENV:-.venv-peers}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-llama-cpp-python==0.3.36}
test -d "$VENV" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q pip==26.3
# Native CPU code (-march=native), OpenMP threads as llama.cpp ships them. On a CPU with AMX
# (Sapphire Rapids and later), llama.cpp 0.3.36's AMX matmul dies on its first tile load
# (SIGILL in ggml_backend_amx_mul_mat, even with the tile permission granted: its tile
# config is built on the stack and can be optimized away, ggml-org/llama.cpp PR 26954), so
# the peer is built without AMX there and runs its AVX-512 kernels. PEERS_AMX=1 keeps AMX.
FLAGS=""
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && [ "${PEERS_AMX:-0}" != 1 ]; then
    FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo "AMX on this CPU: building llama.cpp without it (PEERS_AMX=1 keeps it)"
fi
# --force-reinstall: a changed flag must rebuild what an earlier run left in the venv
CFLAGS="${CFLAGS:-} $FLAGS" CXXFLAGS="${CXXFLAGS:-} $FLAGS" \
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$VENV/bin/python" -m pip install -q \
    --no-cache-dir --force-reinstall "$LLAMA_CPP_PYTHON" numpy
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
# A build that dies on this CPU fails here, not in the middle of a benchmark: a forward pass
# over the packaged model, where the service's venv has it.
MODEL=$(.venv/bin/python -c "from prefixrag.app.core.settings import packaged_llm_path as p
print(p())" 2>/dev/null || true)
if [ -n "$MODEL" ]; then
    "$VENV/bin/python" - "$MODEL" <<'PY'
import sys

import llama_cpp

llm = llama_cpp.Llama(sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
llm.eval(list(range(100, 164)))
print("llama.cpp runs on this CPU:", llm.n_tokens, "tokens evaluated")
PY
else
    echo "no service venv (.venv): llama.cpp's forward pass not checked"
fi
