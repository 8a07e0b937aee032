#!/usr/bin/env bash
# The H200 run of the one-call layer batch on CUDA and of the stalled tail, in one device call:
#   here:  make gpu-wheel; transformers==5.24.0 and regex py3.12 wheels in .whl-hf/
#   there: bash benches/gpu_layer_batch_run.sh OUTDIR [STEPS]
# STEPS (default "cuda stall bench-on bench-off"), each under its own timeout capped by what is left of the
# budget (GPU_RUN_BUDGET_S, default 560 s); OUTDIR/steps.tsv gets a line per step, OUTDIR/<step>.log its output:
#   cuda       every CUDA test and the machine-dependent CPU tests (benches/gpu_cuda_tests.sh) into OUTDIR/cuda/
#   stall      the deadline, stall and collected-cache tests (test_deadlines, test_restore_tail), CPU and CUDA, 4 rounds in
#              one process (benches/python/loop_tests.py: every stack on a hang)
#   bench-on   bench_transformers.py --skip-decode at 8K and 32K, a window of every layer in one call per forward
#   bench-off  the same at 8K, layer by layer (the path before), in the same call: compare within it
#   demo       python -m kvtier_demo (the multi-turn chat workload, 8B shape)
#   serving    concurrent requests through SGLang's HiCacheController with kvtier as L3 and an 8B-shaped model:
#              the engine planner on and off, SGLang's best_effort and wait_complete policies (sglang_serving.py)
#   probe      where a demo-sized host hit's time goes (probe_restore_forward.py: 3,136 cached + 576 new tokens, every
#              layer resident, profiled) and the whole prompt through kvtier's cache against DynamicCache's
#   overhead   a host-side timeline of the cache's update calls, layer by layer, against DynamicCache's, after a
#              demo-sized host restore, its loads in flight or settled, prefill and decode (probe_forward_overhead.py)
#   sglang     SGLang's own HiCacheController over kvtier and HiCacheFile on the GPU (benches/gpu_sglang_controller.sh;
#              needs .whl-sg/ from benches/sglang_gpu_wheels.sh)
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_layer_batch_run.sh OUTDIR [STEPS]}
steps=${2:-cuda stall bench-on bench-off}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 1
budget=${GPU_RUN_BUDGET_S:-560}
. benches/gpu_steps.sh
printf 'install\tstarted\t0\n' >> "$out/steps.tsv"
. benches/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl-hf/*.whl || exit 1
printf 'install\t0\t%s\n' "$(( $(date +%s) - t0 ))" >> "$out/steps.tsv"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
for s in $steps; do
  case $s in
    cuda) step cuda 170 bash benches/gpu_cuda_tests.sh "$out/cuda" ;;
    stall) step stall 170 python3 benches/python/loop_tests.py --rounds 4 --hang-s 110 -- \
             tests/test_deadlines.py tests/test_restore_tail.py -k "deadline or stall or collected" -rs ;;
    bench-on) step bench-on 230 python3 benches/python/bench_transformers.py --skip-decode --contexts 8192,32768 \
                --layer-batch on --out "$out/transformers-on.json" ;;
    bench-off) step bench-off 120 python3 benches/python/bench_transformers.py --skip-decode --contexts 8192 \
                 --layer-batch off --out "$out/transformers-off.json" ;;
    demo) step demo 240 python3 -m kvtier_demo ;;
    probe) step probe 200 python3 benches/python/probe_restore_forward.py --ctx 3136 --suffix 576 --variants w32 \
             --reps 5 --recompute --no-cudnn --profile "$out/probe" --out "$out/probe.json" ;;
    overhead) step overhead 150 python3 benches/python/probe_forward_overhead.py --ctx 3136 --suffix 576 --no-cudnn \
                --out "$out/overhead.json" ;;
    sglang) if [ -d .whl-sg ]; then  # (benches/sglang_gpu_wheels.sh)
              python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl-sg/*.whl
              PATH="$site/bin:$PATH" step sglang 320 bash benches/gpu_sglang_controller.sh "$out/sglang" 300
            else echo "sglang: no .whl-sg"; fi ;;
    serving) if [ -d .whl-sg ]; then  # (benches/sglang_gpu_wheels.sh)
               python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl-sg/*.whl
               PATH="$site/bin:$PATH" step serving 300 python3 benches/python/sglang_serving.py --device cuda \
                 --out "$out/serving.json"
             else echo "serving: no .whl-sg"; fi ;;
    *) echo "unknown step $s" ;;
  esac
done
# everything in one archive too (a device call brings back a limited number of files)
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
