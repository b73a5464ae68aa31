#!/usr/bin/env bash
# One prepared GPU session of the cuda_torch backend, for a host lent for minutes with no
# network (docs/benchmarks/2026-12-device-h200.md is the first run's record).
#
#   OUT=DIR WHEELS=DIR BUDGET=SECONDS bash benchmarks/scripts/gpu_session.sh [STAGE ...]
#
# From the repository root. Stages, in the order given (default: all, in this order):
#   install      the wheels in $WHEELS (the core's dependencies the host lacks: pydantic
#                and its parts, gguf, llguidance) and this checkout, without dependencies,
#                into $SITE (default /tmp/site), so the backends' entry points exist;
#                the host's own torch is used as it is (its version is printed)
#   env          nvidia-smi, torch's view of the GPU, `polyengine backends --verbose`
#   check        `polyengine device-check --backend cuda_torch --steps device,cuda_graphs,bench`
#                (the greedy step needs the default model's 94 MB file: left out)
#   pytest       the tests marked gpu of the device path's files (CUDA graphs, the
#                quantized blocks of issue 37, the pages of issue 40)
#   conformance  the whole suite on the GPU (`polyengine conformance --backend cuda_torch
#                -v`, the device check's conformance step with one line per test, so a
#                run cut short by its limit still says what passed)
#   sets         the option sets cuda_torch declares (page_size=16, kv_dtype=bfloat16),
#                one `--option` run each
#   declared     the run without options and the two sets at once, three processes
#                (not in the default list: instead of conformance and sets)
# Every stage runs under its own `timeout`, cut to what is left of $BUDGET (default 400
# s), and the next one runs whatever the last one did; all output goes to
# $OUT/session.log, the reports to $OUT (at most 8 files: what a device run brings back).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-session}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
BUDGET=${BUDGET:-400}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1
START=$(date +%s)

left() { echo $((BUDGET - ($(date +%s) - START))); }

# run NAME LIMIT CMD...: CMD under `timeout`, the limit cut to the budget left.
run() {
  local name=$1 limit=$2 spare
  shift 2
  spare=$(($(left) - 5))
  ((limit > spare)) && limit=$spare
  if ((limit < 20)); then
    echo "== $name: not run ($(left) s of the budget left)"
    return 0
  fi
  echo "== $name: start $(date -u +%H:%M:%S), limit ${limit} s: $*"
  local t0=$(date +%s) rc
  timeout -k 10 "$limit" "$@"
  rc=$?
  echo "== $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (its time limit)') after $(($(date +%s) - t0)) s"
}

stage_install() {
  mkdir -p "$SITE"
  run "install wheels" 90 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl
  run "install polyengine" 90 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --no-cache-dir --upgrade --target "$SITE" .
}

stage_env() {
  run nvidia-smi 20 nvidia-smi
  run "torch" 60 python3 -c "
import sys, torch, numpy, importlib.metadata as md
print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| numpy', numpy.__version__)
print('GPU', torch.cuda.get_device_name(0), 'capability', torch.cuda.get_device_capability(0),
      'memory %.1f GiB' % (torch.cuda.get_device_properties(0).total_memory / 2**30))
for d in ('polyengine', 'pydantic', 'gguf', 'llguidance', 'pytest', 'hypothesis', 'setuptools'):
    print(d, md.version(d))
"
  run "backends" 60 python3 -m polyengine.cli backends --verbose
}

stage_check() {
  run device-check 180 python3 -m polyengine.cli device-check --backend cuda_torch \
    --steps device,cuda_graphs,bench --output "$OUT/device_check.md" --json "$OUT/device_check.json"
}

stage_pytest() {
  run "pytest -m gpu" 180 python3 -m pytest -q -m gpu -rA -p no:cacheprovider \
    tests/test_cuda_torch.py tests/test_packaging.py tests/test_device_blocks.py tests/test_torch_paged.py
}

stage_conformance() {
  run conformance 3600 python3 -m polyengine.cli conformance --backend cuda_torch -v \
    --report-json "$OUT/conformance.json"
}

stage_sets() {
  run "conformance page_size=16" 1800 python3 -m polyengine.cli conformance --backend cuda_torch -v \
    --option page_size=16 --report-json "$OUT/conformance_page_size16.json"
  run "conformance kv_dtype=bfloat16" 1800 python3 -m polyengine.cli conformance --backend cuda_torch -v \
    --option kv_dtype=bfloat16 --report-json "$OUT/conformance_kv_bf16.json"
}

# The run without options and each declared set at once, each in its own process (what
# `--option-sets declared` runs one after the other; the suite's tiny models leave the
# GPU idle, so the three share it and the host's cores): their logs go to
# $OUT/conformance_runs.log, one after the other, when all have ended.
stage_declared() {
  local limit=$(($(left) - 15)) pids=() name opts rc
  if ((limit < 30)); then
    echo "== declared: not run ($(left) s of the budget left)"
    return 0
  fi
  echo "== declared: start $(date -u +%H:%M:%S), limit ${limit} s: the run without options, page_size=16, kv_dtype=bfloat16"
  local t0=$(date +%s)
  for name in conformance conformance_page_size16 conformance_kv_bf16; do
    case $name in
      conformance) opts=() ;;
      conformance_page_size16) opts=(--option page_size=16) ;;
      conformance_kv_bf16) opts=(--option kv_dtype=bfloat16) ;;
    esac
    OMP_NUM_THREADS=5 timeout -k 10 "$limit" python3 -m polyengine.cli conformance --backend cuda_torch -v \
      "${opts[@]}" --report-json "$OUT/$name.json" >"/tmp/$name.log" 2>&1 &
    pids+=($!)
  done
  for name in conformance conformance_page_size16 conformance_kv_bf16; do
    wait "${pids[0]}"
    rc=$?
    pids=("${pids[@]:1}")
    echo "== declared: $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (its time limit)') after $(($(date +%s) - t0)) s"
    grep -A12 "^layer  " "/tmp/$name.log"
    grep -E "^(FAILED|ERROR) |passed|failed" "/tmp/$name.log" | tail -5
    { echo "######## $name"; cat "/tmp/$name.log"; } >>"$OUT/conformance_runs.log"
  done
}

export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
stages=("$@")
((${#stages[@]})) || stages=(install env check pytest conformance sets)
for s in "${stages[@]}"; do
  case $s in
    install | env | check | pytest | conformance | sets | declared) "stage_$s" ;;
    *) echo "gpu_session.sh: unknown stage '$s' (install env check pytest conformance sets declared)"; exit 2 ;;
  esac
done
echo "== done after $(($(date +%s) - START)) s of a $BUDGET s budget"
