#!/usr/bin/env bash
# The wheels that let SGLang 0.5.23's own cache controller, pools and JIT HiCache kernels run on the GPU machine
# (CPython 3.12, torch, nvcc; no network) for `benches/gpu_layer_batch_run.sh OUT sglang`, within a device call's
# 64 MiB: ../shared/anchors/fetch_wheels.sh's set plus ninja, with SGLang's wheel trimmed of what the cache path
# never imports (the server's compiled Rust extensions, multimodal_gen, its test kits; tests/test_sglang_controller.py
# passes over the trimmed package on the CPU).
#   bash benches/sglang_gpu_wheels.sh [DIR]     (default .whl-sg/, ignored by git)
set -eu
cd "$(dirname "$0")/.."
dir=${1:-.whl-sg}
py=${PYTHON:-.venv/bin/python}
bash ../shared/anchors/fetch_wheels.sh "$dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 -d "$dir" ninja
"$py" - "$dir" <<'PY'
import glob, os, sys, zipfile
src = glob.glob(os.path.join(sys.argv[1], "sglang-*.whl"))[0]
drop = lambda n: ((n.startswith("sglang/srt/rust_extensions/_") and n.endswith(".so"))
                  or n.startswith(("sglang/multimodal_gen/", "sglang/test/")))
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(src + ".tmp", "w", zipfile.ZIP_DEFLATED) as zo:
    for info in zi.infolist():
        if drop(info.filename):
            continue
        data = zi.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "\n".join(x for x in data.decode().split("\n") if not drop(x.split(",")[0])).encode()
        zo.writestr(info, data)
os.replace(src + ".tmp", src)
PY
du -sh "$dir"
