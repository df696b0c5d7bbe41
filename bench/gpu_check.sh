#!/usr/bin/env bash
# The GPU check, one entry point for one call of at most 8 minutes on one H100/H200-class GPU (docs/development.md).
# It sets up the device's Python, then runs python -m bench.gpu_check: the race against airbench94 first, then the
# trainer's CUDA paths (pass/fail rows), the blocks' speed and a timm model; every result as JSON under $OUT
# (gpu_check.json after every row, gpu_race.json after every race run, gpu_check.log), a summary at the end.
#
#   bash bench/gpu_check.sh --prepare     here, before the call: the images, the wheels the device lacks
#                                         (pydantic; it has no network) and the blocks' "before" revision (the
#                                         tree travels without git) into the git-ignored data/gpu_check/
#   bash bench/gpu_check.sh               on the device: run(command="bash bench/gpu_check.sh",
#                                         carry=["data/gpu_check"], timeout_s=480)
#   GPU_CHECK_DRY=1 OUT=DIR bash bench/gpu_check.sh     the dry run on the CPU (CI: tests/test_gpu_check.py)
#   bash bench/gpu_check.sh --table DIR/gpu_check.json  the docs' GPU table (docs/results.md#gpu; several files:
#                                                       merged, a rerun's rows replacing the first call's)
# Settings: OUT (default runs/gpu_check), DATA (the archive; default data/gpu_check/, else ../shared/data/),
# BUDGET (seconds for the whole call, default 450), ONLY="race timm" (a rerun of those rows), RUNS (race, 3), PY.
set -u
cd "$(dirname "$0")/.." || exit 2
PREP=data/gpu_check
SHARED=../shared/data/cifar10-train-jpeg.tar.gz
WHEELS="pydantic pydantic_core annotated-types typing-inspection typing_extensions"  # what the device's image lacks
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1  # (every Python here runs from the repository root: python -m bench.NAME)

prepare() {  # here (with a network to the package registry): what the call carries, about 19 MB
  mkdir -p "$PREP/wheels" || exit 2
  cp -f "$SHARED" "$PREP/" || { echo "error: cannot copy $SHARED"; exit 2; }
  local sums=${SHARED%/*}/SHA256SUMS pins=() w pin
  if [ -f "$sums" ] && [ "$(sha256sum < "$PREP/${SHARED##*/}" | cut -d' ' -f1)" != \
       "$(grep -m1 "${SHARED##*/}" "$sums" | cut -d' ' -f1)" ]; then
    echo "error: $PREP/${SHARED##*/} does not match $sums"; exit 2
  fi
  for w in $WHEELS; do  # the versions CI tests (constraints.txt), for the device's Python 3.12 on x86-64
    pin=$(grep -i -m1 "^${w}==" constraints.txt) || { echo "error: $w is not pinned in constraints.txt"; exit 2; }
    pins+=("$pin")
  done
  rm -f "$PREP"/wheels/*.whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$PREP/wheels" "${pins[@]}" || { echo "error: pip download failed"; exit 2; }
  { git rev-parse --short=12 HEAD; git status --porcelain --untracked-files=no | grep -q . && echo "+changes"; } \
    | paste -sd '' > "$PREP/REVISION"
  # the blocks as they were before their speed work, for bench.blocks' "before" (the tree travels without git)
  local before
  before=$(sed -n 's/^BEFORE = "\([0-9a-f]*\)".*/\1/p' bench/blocks.py)
  rm -rf "$PREP/before" && mkdir -p "$PREP/before" || exit 2
  git archive "${before:?no BEFORE in bench/blocks.py}" visattn/attention | tar -x -C "$PREP/before" --strip-components=2 \
    || { echo "error: cannot export the blocks of $before"; exit 2; }
  echo "$before" > "$PREP/before/REVISION"
  echo "prepared $PREP ($(du -sh "$PREP" | cut -f1)): $(ls "$PREP" "$PREP/wheels" | tr '\n' ' ')"
  echo "next: run(command=\"bash bench/gpu_check.sh\", carry=[\"$PREP\"], timeout_s=480)"
}

case "${1:-}" in
  --prepare) prepare; exit 0 ;;
  --table) shift; exec "$PY" -m bench.gpu_check --table "${@:?--table needs a gpu_check.json}" ;;
  "") ;;
  *) echo "usage: bash bench/gpu_check.sh [--prepare | --table JSON]"; exit 2 ;;
esac

OUT=${OUT:-runs/gpu_check}
BUDGET=${BUDGET:-450}
mkdir -p "$OUT" || exit 2
args=(--out "$OUT" --runs "${RUNS:-3}")
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  args+=(--dry --budget "${BUDGET_DRY:-1800}")
else
  # the device's Python has torch, timm and tensorboard, not pydantic: the prepared wheels, installed in seconds
  if ! "$PY" -c "import pydantic, sys; sys.exit(int(pydantic.VERSION.split('.')[0]) < 2)" 2>/dev/null; then
    ls "$PREP"/wheels/*.whl >/dev/null 2>&1 || { echo "error: no pydantic 2 here and no wheels in $PREP/wheels" \
      "(run 'bash bench/gpu_check.sh --prepare' before the call, and carry $PREP)"; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
      "$PREP"/wheels/*.whl || exit 2
    export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
  fi
  DATA=${DATA:-$PREP/cifar10-train-jpeg.tar.gz}
  [ -f "$DATA" ] || DATA=$SHARED
  [ -f "$DATA" ] || { echo "error: no images at $PREP/ or $SHARED (run --prepare, carry $PREP)"; exit 2; }
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  args+=(--data "$DATA" --budget "$((BUDGET - SECONDS - 15))")  # 15 s for the summary and the files' return
fi
# shellcheck disable=SC2086
exec "$PY" -m bench.gpu_check "${args[@]}" ${ONLY:+--only $ONLY}
