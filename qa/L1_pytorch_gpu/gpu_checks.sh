#!/usr/bin/env bash
# One call on the GPU machine (about 4 minutes on an H100): TE's tests/pytorch subsets
# through the yardstick (qa/te_yardstick) and this package's GPU-only test files in
# parallel, then the eager 4-layer benchmark with its breakdown on an idle GPU.
#   bash qa/L1_pytorch_gpu/gpu_checks.sh <TE tests/pytorch> <out dir>
# Wheels the machine lacks (megatron-core, psutil, torchao) may lie in .whl/: they are
# installed into /tmp/site first. YB (yardstick budget per subset, s), COMMIT.
set -u
T=${1:?TE tests/pytorch folder}; OUT=${2:?out dir}; mkdir -p "$OUT"
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      --ignore-requires-python .whl/*.whl 2>&1 | grep -v "already exists"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export YARDSTICK_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}
B=${YB:-90}
Y() { # out workers k files...
  local out=$1 w=$2 k=$3; shift 3
  YARDSTICK_WORKERS=$w YARDSTICK_BUDGET_S=$B YARDSTICK_K="$k" timeout $((B + 30)) \
      bash qa/te_yardstick/run.sh "$T" "$OUT/$out" "$@" > "$OUT/$out.log" 2>&1
}
P="python3 -m pytest -q -p no:cacheprovider -rfE"
Y y_numerics 5 "" test_numerics.py &
Y y_sanity 4 "clamped_swiglu or grouped_linear or amp or inference_mode" test_sanity.py &
Y y_rope 2 "fused_qkv_rope and 4096" test_fused_rope.py &
(timeout 40 python3 qa/L1_pytorch_gpu/gelu_backward_contraction.py
 timeout -s INT 80 $P tests/pytorch/test_fused_producers.py) > "$OUT/tests.log" 2>&1 &
(timeout -s INT 120 $P tests/pytorch/test_torch_compile.py) > "$OUT/tests_compile.log" 2>&1 &
(timeout -s INT 120 $P tests/pytorch/test_autocast_dtypes.py tests/pytorch/test_fp8_transpose_cache.py \
    tests/pytorch/test_linear_save_original_input.py tests/pytorch/test_delay_wgrad_compute.py \
    tests/pytorch/test_clamped_swiglu.py) > "$OUT/tests2.log" 2>&1 &
wait
for f in tests tests_compile tests2; do
  echo "== $f"; grep -iE "contracted" "$OUT/$f.log" | head -3
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$f.log" | tail -12
done
for f in y_numerics y_sanity y_rope; do echo "== $f"; grep -E "passed=" "$OUT/$f.log"; done
timeout 62 python3 benchmarks/bench_transformer_layers.py --modes eager --steps 6 --warmup 2 \
    --profile --out "$OUT" > "$OUT/bench_tl.log" 2>&1
tail -20 "$OUT/bench_tl.log"
