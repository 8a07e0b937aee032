#!/usr/bin/env bash
# The H200 run behind the compressed tiers' figures (benches/RESULTS.md, "Compressed pages"), in one device
# call (< 10 min):
#   here:  make gpu-wheel; pip download transformers==5.24.0 and a recent regex into .whl-hf/;
#          cargo build --release -p kvtier-bench --bench codec, its binary copied to target/kvdump/codec;
#          python3 benches/python/real_kv.py --dump target/kvdump  (real KV: SmolLM2-135M, bf16 and fp8)
#   there: bash benches/gpu_compression_run.sh OUTDIR [WINDOWS] [COMPRESSIONS] [CONTEXTS]
# 1. the codec on this machine's CPU against its disk (benches/codec.rs): real bf16 and fp8 K and V, then the
#    synthetic input; 2. bench_transformers.py's time-to-first-token rows per context, window (default "2") and
#    store compression (default "auto off": compressed, then raw, in the same call).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_compression_run.sh OUTDIR [WINDOWS] [COMPRESSIONS] [CONTEXTS]}
windows=${2:-2}
compressions=${3:-auto off}
contexts=${4:-8192 32768}
. benches/gpu_env.sh
if [ -d .whl-hf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl-hf/*.whl || exit 1
fi
python3 -c "import transformers, kvtier; print('transformers', transformers.__version__, 'kvtier', kvtier.__version__)"
{ nvidia-smi -L; lscpu | grep -E 'Model name|^CPU\(s\)'; df -h .; } > "$out/machine.txt" 2>&1
if [ -x target/kvdump/codec ]; then
  for f in target/kvdump/*.bin; do
    # one page's object: SmolLM2's 30 layers x 64 tokens x 3 heads x 64 dims, 2 bytes (bf16) or 1 (fp8)
    case $f in *bf16*) e=bits16 obj=737280 ;; *) e=bits8 obj=368640 ;; esac
    KVTIER_CODEC_INPUT=$f KVTIER_CODEC_ELEM=$e KVTIER_CODEC_OBJECT=$obj KVTIER_BENCH_DIR=$PWD \
      timeout 120 target/kvdump/codec > "$out/codec-$(basename $f .bin).log" 2>&1
    echo "codec $f exit $?"; tail -5 "$out/codec-$(basename $f .bin).log"
  done
  KVTIER_BENCH_DIR=$PWD timeout 120 target/kvdump/codec > "$out/codec-synthetic.log" 2>&1
  echo "codec synthetic exit $?"; tail -5 "$out/codec-synthetic.log"
fi
for ctx in $contexts; do
  for w in $windows; do
    for c in $compressions; do
      timeout 240 python3 benches/python/bench_transformers.py --skip-decode --contexts $ctx --window "$w" \
        --compression $c --out "$out/h200-transformers-ttft-$ctx-w$w-$c.json" > "$out/bench-transformers-$ctx-w$w-$c.log" 2>&1
      echo "bench $ctx window $w compression $c exit $?"; tail -5 "$out/bench-transformers-$ctx-w$w-$c.log" | cut -c1-400
    done
  done
done
