#!/usr/bin/env bash
# The placement ablation of the README (identity-initialised se, eca and cbam in each attn_position of
# resnet_fast, the CPU recipe's 4 epochs, seeds 0-2, paired with resnet_fast_none), seed-major so that a
# partial sweep still pairs every variant. Resumable: bench/attention_table.py skips the runs already recorded.
#   bash bench/placement_sweep.sh [seeds...]        (THREADS=1 while other work shares the cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
seeds=${*:-0 1 2}
configs="configs/attention/resnet_fast_none.yaml configs/attention/resnet_fast_se.yaml configs/attention/resnet_fast_eca.yaml configs/attention/resnet_fast_cbam.yaml"
for seed in $seeds; do
  for pos in unit_bn unit_act group_act; do
    $PY bench/attention_table.py --configs $configs --seeds "$seed" --tag "identity-$pos" ${THREADS:+--threads $THREADS} \
      --set model.attn_kwargs.init=identity "model.attn_position=$pos" | grep "seed $seed:" || true
  done
done
