#!/usr/bin/env bash
# The attention table at a longer budget on one CUDA GPU, several runs at once (the CPU would need a day).
# Every job is one python -m bench.attention_table run (config, seed) with its own results file; at the end the finished
# ones are gathered into $OUT/results.json (and the logs into $OUT/logs.tgz: few files, as a device's transfer
# back limits their count), so what finished before the deadline comes back, and
# `python -m bench.attention_report --merge results.json` adds it to the committed table (the table keys runs by
# precision and kernel family, so GPU runs never pair with CPU runs). A job stopped at the deadline resumes
# from its checkpoint in $RUNS when the script runs again on the same machine.
# Usage:  DATA=path/to/cifar10-train-jpeg.tar.gz OUT=results_dir [EPOCHS=32] [SEEDS="0 1 2"] [JOBS=5]
#         [DEADLINE=520] [CONFIGS="none se ..."] [ARGS="--tag dry --set ..."]
#         [SKIP_FROM=bench/results/attention_table.json] bash bench/gpu_table.sh
# A (config, seed) that SKIP_FROM already holds at these epochs on this GPU's kernel family, with the model
# options the config (and ARGS' --set) builds now, is skipped
# (SKIP_FROM= runs every one): SEEDS="0 1 2 3 4 5 6 7" adds only the missing seeds.
# Jobs go seed-major (seed 0 of every config, then seed 1, ...) with the slowest configs first in each seed,
# so a deadline still leaves every finished seed paired with resnet_fast_none.
# A backbone variant (ARGS="--tag wide --backbone --set model.widths=[128,384,384]") runs none under the tag
# too, and every CONFIG/wide pairs with resnet_fast_none/wide.
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
SKIP_FROM=${SKIP_FROM-bench/results/attention_table.json}
PY=${PY:-python3}
mkdir -p "$OUT" "$RUNS/table"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # (run from the repository root: python -m bench.NAME)
export DATA OUT RUNS EPOCHS ARGS PY SKIP_FROM

job() {  # job CONFIG SEED
  local t0=$SECONDS
  set -f  # $ARGS splits into words but never globs: model.widths=[128,384,384] stays as written
  # shellcheck disable=SC2086
  "$PY" -m bench.attention_table --configs "configs/attention/resnet_fast_$1.yaml" --seeds "$2" \
      --epochs "$EPOCHS" --results "$RUNS/table/$1-s$2.json" --runs "$RUNS/$1-s$2" --data-root "$DATA" $ARGS \
      > "$RUNS/table/$1-s$2.log" 2>&1
  echo "$1 seed $2: exit $? after $((SECONDS - t0)) s: $(grep -m1 ' val ' "$RUNS/table/$1-s$2.log")"
}
export -f job

# one process: the versions and device, the decoded-image cache (written once, before the jobs that read it start
# together), then the jobs, less the runs the committed table already holds (same config, tag, model options,
# seed, epochs, precision and kernel family: this GPU's name), so asking for seeds 0-7 runs only the missing
# pairs; SKIP_FROM= runs all
"$PY" - "$SEEDS" "$CONFIGS" "$RUNS/jobs.txt" <<'EOF' || { echo "=== cannot list the jobs"; exit 1; }
import json, os, shlex, sys
from pathlib import Path
import torch
print("torch", torch.__version__, "| cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU", flush=True)
from visattn.config import load_config
from visattn.data import load_splits
try:
    load_splits(load_config("configs/cifar10_cpu.yaml", [f"data.root={os.environ['DATA']}"]).data, 0)
    print("data cache ready", flush=True)
except Exception as e:
    print(f"no cache warm-up ({e}); each job reads its data itself", flush=True)
import bench.attention_table as t
opts = t.make_parser().parse_known_args(shlex.split(os.environ["ARGS"]))[0]  # the job's --tag, --set, ...
skip = Path(os.environ["SKIP_FROM"]) if os.environ["SKIP_FROM"] else None
configs = {c: f"configs/attention/resnet_fast_{c}.yaml" for c in sys.argv[2].split()}
have = json.loads(skip.read_text()) if skip and skip.is_file() else []
have = t.current(have, list(configs.values()), opts.tag, opts.set, opts.backbone)  # as the configs build now
num = {c: t.planned_numerics(config, opts.precision) for c, config in configs.items()}
jobs = []
for s in sys.argv[1].split():
    for c, config in configs.items():
        tag = t.variant(config, opts.tag, opts.backbone)
        if t.ran(have, config, int(s), int(os.environ["EPOCHS"]), tag, num[c]):
            print(f"skipping {t.run_name(config, tag)} seed {s}: in {skip} ({os.environ['EPOCHS']} epochs, {num[c]})",
                  file=sys.stderr)
        else:
            jobs.append(f"{c} {s}\n")
Path(sys.argv[3]).write_text("".join(jobs))
EOF
echo "=== $(wc -l < "$RUNS/jobs.txt") runs to go"
timeout "$DEADLINE" xargs -P "$JOBS" -L 1 bash -c 'job "$0" "$1"' < "$RUNS/jobs.txt"
rc=$?
pkill -TERM -f -- "--runs $RUNS/"  # this script's runs still going at the deadline stop (resumable from $RUNS)
"$PY" - "$RUNS/table" "$OUT/results.json" "$JOBS" <<'EOF'
import json, sys
from pathlib import Path
runs = [r for p in sorted(Path(sys.argv[1]).glob("*.json")) for r in json.loads(p.read_text())]
if int(sys.argv[3]) > 1:  # their times shared the device: never quoted as speed (attention_table.quiet)
    runs = [dict(r, contended=f"{sys.argv[3]} runs at once (bench/gpu_table.sh JOBS={sys.argv[3]})") for r in runs]
Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
print(f"=== {len(runs)} finished runs in {sys.argv[2]}")
EOF
tar czf "$OUT/logs.tgz" -C "$RUNS/table" . 2>/dev/null
echo "=== done (xargs exit $rc)"
