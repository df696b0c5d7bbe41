#!/usr/bin/env bash
# The grid pointing game's 12 checkpoints (docs/maps.md "Grid pointing game"): none, CBAM, coordinate, GC
# (resnet_fast, the attention table's configs), the transformer recipe (vit_cpu) and CCT-2 (cct_2), seeds 0 and 1,
# each trained on single images at the CPU recipe's 4 epochs, into runs/grid/<name>-s<seed>. Resumable: a run whose
# metrics.jsonl holds its last epoch is skipped, one with a last.pt continues from it. One job at a time.
#   bash bench/grid_train.sh            then   .venv/bin/python -m bench.grid_game runs/grid/*
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
EPOCHS=${EPOCHS:-4}
CONFIGS=${CONFIGS:-"configs/attention/resnet_fast_none.yaml configs/attention/resnet_fast_cbam.yaml configs/attention/resnet_fast_coord.yaml configs/attention/resnet_fast_gc.yaml configs/vit_cpu.yaml configs/cct_2.yaml"}
for seed in ${SEEDS:-0 1}; do
  for cfg in $CONFIGS; do
    name=$(basename "$cfg" .yaml); dir="runs/grid/$name-s$seed"
    done_epochs=$($PY - "$dir" <<'PY'
import json, sys, pathlib
p = pathlib.Path(sys.argv[1]) / "metrics.jsonl"
rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
print(max([int(r.get("epoch", 0)) for r in rows if "val_acc" in r] or [0]))
PY
)
    if [ "$done_epochs" -ge "$EPOCHS" ]; then echo "grid_train: $dir done ($done_epochs epochs)"; continue; fi
    resume=(); [ -f "$dir/last.pt" ] && resume=(--resume)
    echo "grid_train: $dir (from epoch $done_epochs) $(date -u +%H:%M:%S)"
    $PY train.py --config "$cfg" "${resume[@]}" run_dir="$dir" seed="$seed" train.epochs="$EPOCHS" log.progress=false
  done
done
