#!/usr/bin/env bash
# What memlab checks on a GPU, in stages that each fit one run on the GPU machine
# (../shared/notes/gpu-machine.md: torch is there; the rest travels as wheels in .whl/).
#
#   bash scripts/gpu_session.sh STAGE...      (in the checkout's root)
#
#   cuda       the `cuda` tests alone (a minute: the first thing to run on a fresh GPU machine)
#   tests      the suite, `cuda` tests included, but not the browser, Binder, lint or notebooks
#   traces     small real allocator traces -> tests/data/trace-*.json.gz
#   validate   the estimator against the GPU -> benchmarks/results/estimator-gpu.{md,jsonl},
#              with every measured run's allocator trace (validate-traces/)
#   bench      %%gpumem, what-if and breakdown overhead -> benchmarks/results/{magic,whatif,breakdown}-gpu.md
#   magic, breakdown, parts
#              bench's %%gpumem and breakdown rows alone, and where a breakdown's time goes
#              -> benchmarks/results/{magic,breakdown,cuda-log-parts}-gpu.md
#   magicparts where `%%gpumem -q -b`'s time goes in a kernel -> benchmarks/results/magic-parts-gpu.md
#   notebooks  every notebook, executed -> notebooks-gpu/*.ipynb
#
# Everything the stages write goes to $OUT (default /tmp/gpu-out) as one results.tar.gz, laid
# out as in the repository, with logs/STAGE.log and logs/env.log beside (stages run in later
# calls on the same machine add to it). Without a GPU the stages still run (predictions only,
# CPU sizes): that is how this script is tested.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-out}"
results="${MEMLAB_GPU_RESULTS:-/tmp/gpu-results}"
mkdir -p "$out" "$results"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
py=${MEMLAB_PY:-python3}
# The GPU machine lacks IPython and the rest: install the carried wheels, once per machine.
if ! $py -c "import IPython" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  [ -d /tmp/site ] || $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
gpu=$($py -c "import torch; print(int(torch.cuda.is_available()))")

logs="$results/logs"
mkdir -p "$logs" "$results/benchmarks/results" "$results/tests/data"
# One call on the GPU machine may last 600 s: the stages share MEMLAB_GPU_BUDGET seconds (570
# by default), and what is left when one runs bounds it, so the archive is always written.
budget=${MEMLAB_GPU_BUDGET:-570}
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log to logs/NAME.log
  local name=$1 limit=$2
  shift 2
  local left=$((budget - SECONDS - 20))  # 20 s kept for the archive
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, $left s left of this call's budget (run it in the next call)"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name ($(date +%T), at most ${limit}s)"
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1
  echo "== $name: exit $? ($(date +%T))"
  tail -n 15 "$logs/$name.log"
}

{
  date
  nvidia-smi 2>/dev/null || echo "no nvidia-smi"
  $py -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
} > "$logs/env.log" 2>&1
grep -E "^torch" "$logs/env.log"
for s in "$@"; do
  case $s in
    cuda)
      stage cuda 240 $py -m pytest -q -p no:cacheprovider tests -m cuda \
        --junitxml="$results/cuda-junit.xml" ;;
    tests)
      stage tests 420 $py -m pytest -q -p no:cacheprovider tests -m "not slow" \
        --ignore=tests/test_browser.py --ignore=tests/test_binder.py \
        --ignore=tests/test_packaging.py --junitxml="$results/tests-junit.xml" ;;
    traces)
      if [ "$gpu" = 1 ]; then
        stage traces 300 $py benchmarks/record_traces.py --out "$results/tests/data"
      else
        stage traces 300 $py benchmarks/record_traces.py --dry-run
      fi ;;
    validate)
      dry=(); [ "$gpu" = 1 ] || dry=(--dry-run --models mlp lstm)
      stage validate 560 $py benchmarks/validate_estimator.py "${dry[@]}" --jobs 6 \
        --out "$results/benchmarks/results/estimator-gpu.md" \
        --json "$results/benchmarks/results/estimator-gpu.jsonl" \
        --traces "$results/validate-traces" ;;
    bench)
      stage bench-magic 240 $py benchmarks/bench_magic.py --repeat 100 \
        --out "$results/benchmarks/results/magic-gpu.md"
      stage bench-whatif 200 $py benchmarks/bench_whatif.py \
        --out "$results/benchmarks/results/whatif-gpu.md"
      stage bench-breakdown 120 $py benchmarks/bench_gpu_breakdown.py \
        --out "$results/benchmarks/results/breakdown-gpu.md" ;;
    magic)
      stage bench-magic 240 $py benchmarks/bench_magic.py --repeat 200 \
        --out "$results/benchmarks/results/magic-gpu.md" ;;
    breakdown)
      stage bench-breakdown 150 $py benchmarks/bench_gpu_breakdown.py \
        --out "$results/benchmarks/results/breakdown-gpu.md" ;;
    parts)
      stage bench-parts 120 $py benchmarks/bench_cuda_log_parts.py --rounds 30 --dump "$results/cuda-log-magic.json.gz" \
        --out "$results/benchmarks/results/cuda-log-parts-gpu.md" ;;
    magicparts)
      stage bench-magic-parts 120 $py benchmarks/bench_magic_parts.py --repeat 40 \
        --out "$results/benchmarks/results/magic-parts-gpu.md" ;;
    notebooks)
      stage notebooks 560 $py scripts/run_notebooks.py --jobs 4 --timeout 300 \
        --out "$results/notebooks-gpu" ;;
    *) echo "unknown stage $s: cuda, tests, traces, validate, bench, magic, breakdown, parts, magicparts or notebooks" >&2 ;;
  esac
done

# What comes back: one archive (a file may be at most 16 MiB).
tar czf "$out/results.tar.gz" -C "$results" .
ls -l "$out"
size=$(stat -c %s "$out/results.tar.gz")
if [ "$size" -gt $((15 * 1024 * 1024)) ]; then  # too big to come back: leave the run traces out
  tar czf "$out/results.tar.gz" -C "$results" --exclude=validate-traces .
  echo "results.tar.gz was $size B: validate-traces left out"
fi
