#!/usr/bin/env bash
# The attention table at a longer budget on one CUDA GPU, several runs at once (the CPU would need a day).
# Every job is one bench/attention_table.py run (config, seed) with its own results file under $OUT/table/, so
# what finished before the deadline comes back; bench/merge_results.py adds them to the committed table (the
# table keys runs by precision and kernel family, so GPU runs never pair with CPU runs).
# Usage:  DATA=path/to/cifar10-train-jpeg.tar.gz OUT=results_dir [EPOCHS=32] [SEEDS="0 1 2"] [JOBS=5]
#         [DEADLINE=520] [CONFIGS="none se ..."] [ARGS="--tag dry --set ..."] bash bench/gpu_table.sh
# Jobs go seed-major (seed 0 of every config, then seed 1, ...) with the slowest configs first in each seed,
# so a deadline still leaves every finished seed paired with resnet_fast_none.
set -u
DATA=${DATA:-../shared/data/cifar10-train-jpeg.tar.gz}
OUT=${OUT:-runs/gpu_table}
RUNS=${RUNS:-/tmp/visattn_gpu_table}
EPOCHS=${EPOCHS:-32}
SEEDS=${SEEDS:-0 1 2}
JOBS=${JOBS:-5}
DEADLINE=${DEADLINE:-520}
CONFIGS=${CONFIGS:-mhsa2d nonlocal cbam coord gc spatial se eca none}
ARGS=${ARGS:-}
PY=${PY:-python3}
mkdir -p "$OUT/table" "$RUNS"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export DATA OUT RUNS EPOCHS ARGS PY

"$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "| cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU", flush=True)
EOF

job() {  # job CONFIG SEED
  local t0=$SECONDS
  # shellcheck disable=SC2086
  "$PY" bench/attention_table.py --configs "configs/attention/resnet_fast_$1.yaml" --seeds "$2" \
      --epochs "$EPOCHS" --results "$OUT/table/$1-s$2.json" --runs "$RUNS/$1-s$2" --data-root "$DATA" $ARGS \
      > "$OUT/table/$1-s$2.log" 2>&1
  echo "$1 seed $2: exit $? after $((SECONDS - t0)) s: $(grep -m1 ' val ' "$OUT/table/$1-s$2.log")"
}
export -f job

# the decoded-image cache is written once, before the jobs that read it start together
"$PY" -c "
import sys; sys.path.insert(0, '.')
from visattn.config import load_config
from visattn.data import load_splits
load_splits(load_config('configs/cifar10_cpu.yaml', ['data.root=$DATA']).data, 0)
print('data cache ready', flush=True)" || echo "cache warm-up failed; each job decodes the data itself"

for s in $SEEDS; do for c in $CONFIGS; do echo "$c $s"; done; done |
  timeout "$DEADLINE" xargs -P "$JOBS" -L 1 bash -c 'job "$0" "$1"'
rc=$?
pkill -TERM -f bench/attention_table.py  # runs still going at the deadline stop (their results are not kept)
echo "=== done (exit $rc); finished runs: $(ls "$OUT"/table/*.json 2>/dev/null | wc -l)"
