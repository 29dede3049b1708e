#!/usr/bin/env bash
# What Stratagem runs on a lent NVIDIA GPU machine (one `run` call of at most 8 minutes). Writes under $OUT;
# copy $OUT to benchmarks/data/<gpu>/ afterwards.
#   OUT=/tmp/out bash tools/gpu_session.sh           # speed (default): launch MFU / step time / peak memory of
#                                                    # gpt2-large mb 4 and a Llama-3-8B-shaped model beside their
#                                                    # predictions (benchmarks/gpu_speed.py), then the `gpu` tests
#   OUT=/tmp/out bash tools/gpu_session.sh full|quick|final   # the GEMM sweep and GPT-2 runs of earlier sessions
# The machine's python has torch; the planner's own dependencies not there travel as wheels in .whl/ (pure-Python
# ones plus pydantic-core for several Pythons: each wheel that does not fit this Python is skipped).
set -u
OUT=${OUT:-/tmp/stratagem-gpu}; mkdir -p "$OUT"
MODE=${1:-speed}
export PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  for w in .whl/*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" \
      >/dev/null 2>&1 || echo "skipped $(basename "$w")"
  done
  export PYTHONPATH=$PWD:/tmp/site
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
S="python3 -m planner.cli.main"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, pulp, pydantic, planner, runtime; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('cbc', pulp.PULP_CBC_CMD().available())" | tee -a "$OUT/gpu.txt"
step() { echo; echo "=== $* ($(date -u +%T))"; }
Q=""; [ "$MODE" = quick ] && Q="--quick"
if [ "$MODE" = speed ]; then  # one archive back (the device tool returns a limited number of files)
  D="$OUT/data"; mkdir -p "$D"; cp "$OUT/gpu.txt" "$D/machine.txt"
  step kernel test  # first: the fused optimizer kernel the one-rank defaults run (seconds)
  timeout 60 python3 -m pytest -q -m gpu tests/test_gpu.py -k master_adamw -p no:cacheprovider --timeout 50 \
    --timeout-method=signal -rA > "$D/kernel_test.log" 2>&1
  tail -n 3 "$D/kernel_test.log"
  step launch speed
  RUNS=gpt2-large_mb4,llama3-8b-l8_mb1_s8192,llama3-8b-l8_mb1_s8192_no_cudagraphs,gpt2-large_mb4_no_cudagraphs,gpt2-large_mb4_math_eager
  timeout 300 python3 benchmarks/gpu_speed.py --out "$D" --only "$RUNS" --run-timeout 100 > "$D/speed.log" 2>&1
  tail -n 40 "$D/speed.log"
  step gpu tests
  timeout 110 python3 -m pytest -q -m gpu tests/test_gpu.py -k "not master_adamw" -p no:cacheprovider \
    --timeout 100 --timeout-method=signal -rA > "$D/tests.log" 2>&1
  tail -n 5 "$D/tests.log"
  tar -C "$OUT" -czf "$OUT/session.tgz" data && rm -rf "$D"; ls -la "$OUT"; exit 0
fi
if [ "$MODE" = final ]; then  # the runs, the unaligned LM heads and the profiler test
  step odd gemms
  python3 benchmarks/gpu_gemm_check.py --cluster dgx-h100 --odd --out "$OUT/gemm_odd.csv" > "$OUT/gemm_odd.log" 2>&1; tail -n 3 "$OUT/gemm_odd.log"
  step end-to-end runs
  timeout 270 python3 benchmarks/gpu_runs.py --out "$OUT" --steps 6 2>&1 | tail -n 14
  step profile test
  timeout 170 python3 -m pytest -q -m gpu tests/test_gpu.py -k profile -p no:cacheprovider --timeout 160 -rA > "$OUT/tests.log" 2>&1; tail -n 4 "$OUT/tests.log"
  ls -la "$OUT"; exit 0
fi
step gemm sweep
python3 benchmarks/gpu_gemm_check.py --cluster dgx-h100 --out "$OUT/gemm.csv" $Q > "$OUT/gemm.log" 2>&1; tail -n 4 "$OUT/gemm.log"
step gpu tests
timeout 280 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 80 -rA > "$OUT/tests.log" 2>&1; tail -n 5 "$OUT/tests.log"
step profiled steps
for cfg in "gpt:gpt2 4 1" "gpt:gpt2-medium 4 1"; do
  set -- $cfg
  STRATAGEM_TORCH_PROFILE=/tmp/prof-${1#gpt:} timeout 120 python3 benchmarks/gpu_runs.py --out /tmp/prof-runs --only "$1" "$2" "$3" > /dev/null 2>&1
  cat /tmp/prof-${1#gpt:}/rank0_step3.txt >> "$OUT/prof.txt" 2>/dev/null
done
head -c 3000 "$OUT/prof.txt"
step end-to-end runs
if [ "$MODE" = full ]; then
  timeout 300 python3 benchmarks/gpu_runs.py --out "$OUT" 2>&1 | tail -n 20
else
  timeout 200 python3 benchmarks/gpu_runs.py --out "$OUT" --quick 2>&1 | tail -n 20
fi
ls -la "$OUT"
