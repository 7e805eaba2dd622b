#!/usr/bin/env bash
# CUDA graphs on the GPU, in about four minutes: the graph and graph-safe RNG tests, the
# train_gpt.py --cuda-graphs tests, then the three graph benchmarks with small repeat
# counts. Results (JSON, and each step's log) go to $OUT when set, else to
# benchmarks/out (git-ignored; OUT=benchmarks/results records them). Uses the python3
# found there with its own torch, as test.sh does.
# Usage: bash qa/L1_pytorch_gpu/graphs.sh
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/benchmarks/out}"
mkdir -p "$OUT"
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1     # the image's pytest plugins are not ours

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__)" || exit 1
FAILED=()
step() {                                    # step NAME COMMAND...: run, log, remember failures
    local name=$1
    shift
    echo "=== $name: $*"
    local start=$SECONDS
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc, $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || FAILED+=("$name")
}

step tests_graphs "$PY" -m pytest -q -p no:cacheprovider -rfEs \
    tests/pytorch/test_graph.py tests/pytorch/test_graph_mx.py tests/pytorch/test_graph_dropout.py \
    tests/pytorch/test_rng_tracker.py tests/pytorch/test_checkpoint_replay.py
step tests_train_gpt "$PY" -m pytest -q -p no:cacheprovider -rfEs \
    tests/pytorch/test_train_gpt.py -k "cuda_graphs or bit_identical"
step bench_linear "$PY" benchmarks/bench_linear.py --shapes graphs --no-torchao \
    --variants te_fp8 --rep-ms 50 --out "$OUT"
step bench_graphs "$PY" benchmarks/bench_graphs.py --rep-ms 100 --out "$OUT"
step bench_graphs_dropout "$PY" benchmarks/bench_graphs.py --parts model --dropout 0.1 \
    --rep-ms 100 --out "$OUT/dropout"
step bench_train_gpt "$PY" benchmarks/bench_train_gpt.py --steps 30 --out "$OUT"

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED: ${FAILED[*]}"
    exit 1
fi
echo "All graph tests and benchmarks ran; results in $OUT"
