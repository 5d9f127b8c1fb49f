#!/usr/bin/env bash
# The GPU evidence run on the project's H200 (it has no network): wheels the machine
# lacks come from .whl/ (nvidia-cutlass, tokenspeed-deepgemm, hypothesis, pytest-xdist and their needs), then the
# GPU tests and benchmarks named by STAGE. Logs and raw sanitizer reports go to $OUT.
#   Three stages cover the WHOLE test suite, each under the machine's 10-minute command limit:
#   STAGE=tests  : every test not marked gpu (CPU tests must pass on a GPU machine too)
#   STAGE=gpu    : every gpu-marked test except the packaged kernel's
#   STAGE=bench  : replay / hooks benchmarks (and the lab's reference timing), and the planted-bug
#                  CLI demos
#   STAGE=flight : the flight recorder: its GPU tests, the MoE decode example recorded with the
#                  fault variant and salvaged/replayed through the CLI, bench/bench_flight.py,
#                  lab/bench_snapshot_kernel.py and lab/profile_flight_step.py
#                  (SNAP_ARGS: more arguments of bench_snapshot_kernel.py, e.g. "--variant
#                  KD_OVERLAP=0"; FLIGHT_ARGS: of bench_flight.py, e.g. "--tokens 1,32";
#                  LAB_FLIGHT_ARGS, when set, runs lab/flight_variants.py with them, e.g.
#                  "--define KD_DENSE=0")
#   STAGE=sm120  : the packaged kernel: its GPU tests, `kdump doctor --selftest`, its benchmark
#                  (lab/bench_sm120.py; SWEEP=1 adds lab/sweep_sm120.py, SWEEP_ARGS its variants;
#                  NOBENCH=1 skips)
#   STAGE=profile: Nsight Compute on the packaged kernel, CASES="shape:tokens ..." (default
#                  "w13:1 w13:113": decode and MMA-bound); VARIANT="k=v,..." profiles a
#                  TileConfig variant (see lab/sweep_sm120.py)
set -o pipefail
OUT=${OUT:-/tmp/kdump-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site KDUMP_CACHE_DIR=/tmp/kdc DG_JIT_CACHE_DIR=/tmp/dgjit
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, deep_gemm; print('torch', torch.__version__, 'deep_gemm', deep_gemm.__version__)"
python3 -m kdump doctor
case "${STAGE:-tests}" in
tests)
  # 16 cores: spread the CPU tests over 8 pytest-xdist workers when its wheel came along
  xd=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
  timeout 540 python3 -m pytest -q -rfE -m "not gpu" $xd 2>&1 | tee "$OUT/pytest-cpu.log"
  ;;
gpu)
  timeout 540 python3 -m pytest -q -rfE -m gpu --ignore tests/test_sm120_gpu.py --ignore tests/test_flight_gpu.py 2>&1 | tee "$OUT/pytest-gpu.log"
  ;;
flight)
  timeout 300 python3 -m pytest -q -rfE -m gpu tests/test_flight_gpu.py 2>&1 | tee "$OUT/pytest-flight.log"
  rm -rf /tmp/fl && timeout 120 python3 -m kdump record -o /tmp/fl -t kdump.kernels.sm120.faulty:m_grouped_fp8_gemm_nt_contiguous -- python3 examples/moe_decode.py --backend faulty --steps 6 2>&1 | tee "$OUT/flight-record.log"
  # the salvaged bundle of the last graph replay (the one the loop failed at)
  b=$(python3 -c "import glob, kdump; print(max((p for p in glob.glob('/tmp/fl/flight.*/journal-*.kdump') if 'graph_replay' in kdump.load_bundle(p).info), key=lambda p: kdump.load_bundle(p).calls[-1].meta['journal']['seq']))")
  timeout 120 python3 -m kdump replay "$b" --backend packaged-faulty 2>&1 | tee "$OUT/flight-replay.log"; echo "replay exit ${PIPESTATUS[0]}" | tee -a "$OUT/flight-replay.log"
  timeout 240 python3 bench/bench_flight.py ${FLIGHT_ARGS} 2>&1 | tee "$OUT/bench-flight.log"
  [ -n "$LAB_FLIGHT_ARGS" ] && timeout 240 python3 lab/flight_variants.py ${LAB_FLIGHT_ARGS} 2>&1 | tee "$OUT/lab-flight.log"
  # the snapshot kernel alone against a plain copy (add --variant NAME=VALUE to compare builds)
  timeout 120 python3 lab/bench_snapshot_kernel.py ${SNAP_ARGS} 2>&1 | tee "$OUT/bench-snapshot-kernel.log"
  # one recorded graph step's device timeline (kernels, memcpys), metadata and scales only
  timeout 60 python3 lab/profile_flight_step.py --tokens 1 --scales-only 2>&1 | tee "$OUT/profile-step.log"
  ;;
bench)
  # planted bug (packaged kernel's stale-schedule variant) and a clean DeepGEMM call through the
  # CLI; their raw sanitizer reports become tests/data fixtures for the parser tests
  python3 - <<'PY'
from kdump.bundle import capture_call, save_calls
from kdump.kernels.registry import spec_for
spec = spec_for("deep_gemm:m_grouped_fp8_gemm_nt_contiguous")
for name, fmt, kw in (("fault", "ue8m0", dict(num_groups=8, n=256, k=512, expected_m=100,
                                                empty_groups=3)),
                      ("dg", "fp32", dict(num_groups=32, n=512, k=1024, expected_m=64))):
    args, kwargs = spec.generate(seed=5, device="cuda", scale_format=fmt, **kw)
    save_calls(f"/tmp/{name}.kdump", [capture_call(spec.id, args, kwargs, names=spec.param_names())])
PY
  timeout 120 python3 -m kdump replay /tmp/fault.kdump --backend packaged-faulty --mode graph 2>&1 | tee "$OUT/cli-fault-graph.log"
  timeout 200 python3 -m kdump replay /tmp/fault.kdump --backend packaged-faulty --mode sanitizer --graph --sanitizer-logs "$OUT/san" 2>&1 | tee "$OUT/cli-fault-sanitizer.log"
  timeout 200 python3 -m kdump replay /tmp/dg.kdump --backend deep_gemm --mode all --sanitizer-logs "$OUT/san" 2>&1 | tee "$OUT/cli-dg-all.log"
  timeout 200 python3 bench/bench_replay.py --backend deep_gemm --tokens 32 2>&1 | tee "$OUT/bench-replay.log"
  timeout 150 python3 lab/bench_reference.py --no-append 2>&1 | tee "$OUT/bench-reference.log"
  timeout 100 python3 bench/bench_hooks.py 2>&1 | tee "$OUT/bench-hooks.log"
  ;;
sm120)
  timeout 60 python3 scripts/sm120-smoke.py 2>&1 | tee "$OUT/smoke.log" || exit 1
  timeout 220 python3 -m pytest -m gpu -q -x tests/test_sm120_gpu.py 2>&1 | tee "$OUT/pytest-sm120.log"
  timeout 40 python3 -m kdump doctor --selftest 2>&1 | tee "$OUT/doctor-selftest.log"
  [ -n "$SWEEP" ] && timeout 300 python3 lab/sweep_sm120.py --iters 10 ${SWEEP_ARGS} 2>&1 | tee "$OUT/sweep-sm120.log"
  [ -z "$NOBENCH" ] && timeout 240 python3 lab/bench_sm120.py --iters 15 --out "$OUT/RESULTS_sm120.md" 2>&1 | tee "$OUT/bench-sm120.log"
  ;;
profile)
  # ncu locks the SM clock (1.37 GHz on the H200): compare ratios, not durations, with the bench
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for case in ${CASES:-w13:1 w13:113}; do
    shape=${case%%:*} t=${case##*:}
    timeout 150 "$ncu" --kernel-name regex:kd_gemm --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
      --section InstructionStats \
      --import-source yes -f -o "$OUT/$shape-$t" \
      python3 lab/profile_case.py "$shape" "$t" ${VARIANT:+--variant "$VARIANT"} \
      > "$OUT/ncu-$shape-$t.log" 2>&1
    "$ncu" -i "$OUT/$shape-$t.ncu-rep" >> "$OUT/ncu-$shape-$t.log" 2>&1
    # per-SASS-instruction samples (stall reasons) for reading offline
    "$ncu" -i "$OUT/$shape-$t.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/sass-$shape-$t.csv" 2>&1
  done
  ;;
esac
