#!/usr/bin/env bash
# The GPU checks in one command, for a CUDA machine (figures in docs/results.md, section "GPU"):
#   1. configs/cifar10_gpu.yaml end to end (resnet_fast at airbench94's setting, 10 epochs, bf16 autocast,
#      channels_last, torch.compile; until issue 64 ResNet-18 + SE with EMA: docs/changelog.md),
#   2. the CPU recipe (configs/cifar10_cpu.yaml, 4 epochs) on the GPU under bf16,
#   3. the same under fp16 autocast with a GradScaler,
#   4. the GPU recipe eager (compile=false) for 3 epochs, to set its images/s against step 1's compiled ones.
# Usage:  DATA=path/to/cifar10-train-jpeg.tar.gz OUT=results_dir [SEEDS="0 1"] [ALL=] bash bench/gpu_recipe.sh
# Each step has its own time limit, so one that fails or overruns leaves the others' results. EXTRA holds
# overrides for every step (a dry run on the CPU: EXTRA="device=cpu data.subset=500 train.max_steps=2").
set -u
DATA=${DATA:-../shared/data/cifar10-train-jpeg.tar.gz}
OUT=${OUT:-runs/gpu_recipe}
RUNS=${RUNS:-/tmp/visattn_gpu_runs}
EXTRA=${EXTRA:-}
PY=${PY:-python3}
SEEDS=${SEEDS:-0}   # seeds of the GPU recipe (step 1)
ALL=${ALL-1}        # ALL= (empty) runs step 1 alone
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

"$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "| cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
EOF

step() {  # step NAME SECONDS train.py-arguments...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): train.py $*"
  rm -rf "${RUNS:?}/$name"
  local t0=$SECONDS
  # shellcheck disable=SC2086
  timeout "$limit" "$PY" train.py "$@" data.root="$DATA" run_dir="$RUNS/$name" log.progress=false $EXTRA
  echo "=== $name: exit $? after $((SECONDS - t0)) s"
  cp "$RUNS/$name/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null || echo "=== $name: no metrics.jsonl"
}

for s in $SEEDS; do
  name=gpu_recipe; [ "$s" = 0 ] || name=gpu_recipe_s$s
  step $name 300 -c configs/cifar10_gpu.yaml seed="$s"
  # each run's provenance and its TensorBoard log (attention-map overlays every 5 epochs)
  cp "$RUNS/$name/run_info.json" "$OUT/${name}_run_info.json" 2>/dev/null
  ev=$(ls -S "$RUNS/$name"/tb/events.* 2>/dev/null | head -1); [ -n "$ev" ] && cp "$ev" "$OUT/$name.tfevents"
done
[ -n "$ALL" ] || exit 0
step cpu_recipe_bf16 90 -c configs/cifar10_cpu.yaml
step cpu_recipe_fp16 90 -c configs/cifar10_cpu.yaml precision=fp16
step gpu_recipe_eager 75 -c configs/cifar10_gpu.yaml compile=false train.epochs=3 log.maps_every=0
