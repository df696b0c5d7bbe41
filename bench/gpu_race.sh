#!/usr/bin/env bash
# The GPU race in one command, for a CUDA machine (issue 64; figures go to docs/results.md#gpu and the README):
#   1. decode the images into visattn's cache (so the race's own limit holds only the race),
#   2. bench/gpu_race.py: airbench94 (bench/reference_airbench.py, 9.9 epochs, eager) against
#      configs/cifar10_gpu.yaml (compiled; compile timed apart), 3 runs each, alternating, same split; the time
#      to 90% validation of each and the median ratio visattn / airbench94, in $OUT/gpu_race.json (and .log).
# About 3-5 minutes on one H100/H200 (most of it compiling); step 2 is cut at 420 s, so a 540 s call leaves time.
# Usage:  DATA=path/to/cifar10-train-jpeg.tar.gz OUT=results_dir [PY=python3] [RUNS=3] bash bench/gpu_race.sh
# From a session with the device tool (the archive is 16 MB; data/ is git-ignored, so it travels with carry):
#   cp ../shared/data/cifar10-train-jpeg.tar.gz data/   then   run(command="DATA=data/cifar10-train-jpeg.tar.gz
#   OUT=$OUT bash bench/gpu_race.sh", carry=["data"], timeout_s=540); then copy gpu_race.json to bench/results/.
# A dry run on the CPU: DATA=... OUT=/tmp/race EXTRA="--runs 1 --subset 512 --batch-size 128 --epochs 1
#   --airbench-epochs 1 --set compile=false" bash bench/gpu_race.sh
set -u
DATA=${DATA:-../shared/data/cifar10-train-jpeg.tar.gz}
OUT=${OUT:-runs/gpu_race}
PY=${PY:-python3}
RUNS=${RUNS:-3}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|',
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
t0=$SECONDS
timeout 120 "$PY" -c "import sys; from visattn.config import load_config; from visattn.data import load_splits
load_splits(load_config('configs/cifar10_gpu.yaml', ['data.root=' + sys.argv[1]]).data, 0)" "$DATA"
echo "=== images decoded: exit $? after $((SECONDS - t0)) s"
t0=$SECONDS
# shellcheck disable=SC2086
timeout 420 "$PY" bench/gpu_race.py --runs "$RUNS" --data-root "$DATA" --out "$OUT/gpu_race.json" $EXTRA 2>&1 \
  | tee "$OUT/gpu_race.log"
echo "=== race: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
