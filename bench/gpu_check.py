"""The GPU check: every GPU path of visattn in one device call, each result written as JSON, a summary at the end.

    bash bench/gpu_check.sh                         # on one CUDA GPU: the set-up, then this file (docs/development.md)
    python -m bench.gpu_check --out DIR --data ARCHIVE      # the same without the shell script's set-up
    python -m bench.gpu_check --dry --out DIR       # on the CPU: synthetic images, a few steps, no timing claims (CI)
    python -m bench.gpu_check --table DIR/gpu_check.json    # the docs' GPU table from a check's JSON
    python -m bench.gpu_check --merge first.json rerun.json  # one JSON of a call and a rerun of some rows

The rows, most important first; each runs in a child process under a time guard (what is left of ``--budget``,
and at most the row's own cap), and ``DIR/gpu_check.json`` is rewritten after every row, so a row that overruns
leaves the earlier ones written:

- ``data``: the images decoded once into visattn's cache (every later row reads the cache).
- ``race``: ``configs/cifar10_gpu.yaml`` against airbench94 (``bench/gpu_race.py``, which writes
  ``DIR/gpu_race.json`` after every run), alternating, 3 runs each: time to 90% with compile timed apart and the
  evaluation off the clock, the median ratio visattn / airbench94 and each run's accuracy.
- the trainer's CUDA paths, one short run each on the real images (``train.py`` through this file's ``--child``,
  which adds the probes), each a pass/fail row: ``bf16_compile``; ``fp16_overflow`` (the GradScaler; one step's
  scaled loss is made infinite: the step must be skipped, the weights left as they were, and the skip counted);
  ``channels_last`` (batches and weights in that layout, logits as a contiguous copy gives);
  ``sigterm_resume`` (SIGTERM mid-run, exit 143 with the state saved, ``resume=auto`` to the end);
  ``maps_autocast`` (attention maps and faithfulness logged to TensorBoard under autocast);
  ``torchrun_nccl`` (``torchrun --nproc-per-node=1``: the data-parallel path, DDP on NCCL, forced on for one rank).
- ``blocks``: each block's training-step speed against ``none``, eager, before and after issue 70 (``bench/blocks.py``).
- ``timm``: ``model.name=timm/resnet18 model.cifar_stem=true model.attention=cbam`` through ``train.py`` for one
  epoch ("not available" while visattn refuses the name as an unknown model).

With ``--dry`` every row runs on the CPU at a toy size (the CUDA-only ones say so) and no time is a claim.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from bench.common import ROOT, command, parser, read_results

HERE = "bench.gpu_check"  # its children run it as a module too: python -m bench.gpu_check --child ...

CONFIG = ROOT / "configs" / "cifar10_gpu.yaml"
RESULTS = "gpu_check.json"
OVERFLOW_AT = 3  # the fp16 row's forced overflow: the third step (not a lookahead step: those come every 5)
SIGTERM_AT = 3  # the SIGTERM row signals once the run has logged this step
MIN_START = 10.0  # seconds: a row is not started with less than this left of the budget (on a GPU)
# the rows in order of importance, with each one's cap in seconds on a GPU (a dry run caps them at --budget)
CAPS = {"data": 150, "race": 270, "bf16_compile": 75, "fp16_overflow": 50, "channels_last": 50, "sigterm_resume": 75,
        "maps_autocast": 60, "torchrun_nccl": 60, "blocks": 90, "timm": 60}
WHAT = {"data": "the images decoded into the cache",
        "race": "`configs/cifar10_gpu.yaml` vs airbench94, time to 90% (median ratio)",
        "bf16_compile": "bf16 autocast + `torch.compile`, one epoch",
        "fp16_overflow": "fp16 + GradScaler, a forced overflow skipped and counted",
        "channels_last": "channels_last batches and weights",
        "sigterm_resume": "SIGTERM mid-run, then `resume=auto` to the end",
        "maps_autocast": "attention maps logged under autocast",
        "torchrun_nccl": "`torchrun --nproc-per-node=1`, DDP on NCCL",
        "blocks": "blocks' training step vs `none`, eager",
        "timm": "`timm/resnet18` (CIFAR stem, CBAM) through `train.py`, one epoch"}
# the dry run's toy size: synthetic images (200 to train on, 40 held out), a narrow network, no compile
DRY_DATA = ["data.source=synthetic", "data.synthetic_size=240", "data.val_size=40", "train.batch_size=40",
            "eval.batch_size=40"]
DRY_MODEL = ["model.widths=[8,16,16]"]
DRY_RACE = ["--runs", "1", "--subset", "64", "--batch-size", "32", "--epochs", "1", "--airbench-epochs", "1",
            "--device", "cpu", "--set", "data.source=synthetic", "data.synthetic_size=200", "data.val_size=50",
            "compile=false", "model.widths=[16,32,32]"]
STATUSES = ("pass", "fail", "partial", "timed out", "not run", "not available", "skipped on the CPU")


class Check:
    """Where a check writes, what it runs on and how much time it has left."""

    def __init__(self, out: Path, work: Path, data: str, dry: bool, budget: float, runs: int, py: str = sys.executable):
        self.out, self.work, self.data, self.dry, self.runs, self.py = out, work, data, dry, runs, py
        self.deadline = time.monotonic() + budget
        self.log = out / "gpu_check.log"
        # a dry run forks its ``python SCRIPT ...`` children from this process, which has imported what they need:
        # the same script run as __main__ on the same arguments, without a second interpreter's imports (most of a
        # toy run's time). Never next to CUDA: a GPU run's children are new processes.
        self.fork = dry and hasattr(os, "fork")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def spawn(self, name: str, cmd: List[str], limit: float, env: Optional[Dict[str, str]] = None,
              watch: Optional[Callable[[subprocess.Popen], Any]] = None) -> Dict[str, Any]:
        """Run ``cmd`` (in its own process group) for at most ``limit`` seconds; ``watch(proc)`` is called while it
        runs. Its output goes to the check's log too. Returns rc (None when stopped at the limit), out, err."""
        t0 = time.monotonic()
        with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
            if self.fork and len(cmd) > 2 and cmd[0] == self.py and cmd[1] == "-m" and cmd[2].startswith("bench."):
                proc: Any = Forked(cmd[1:], env or {}, fo, fe)
            else:
                proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                        stdout=fo, stderr=fe, text=True, start_new_session=True)
            watched = watch(proc) if watch is not None else None
            try:
                proc.wait(timeout=max(limit - (time.monotonic() - t0), 1))
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = None
                _stop_group(proc)
            fo.seek(0), fe.seek(0)
            out, err = fo.read(), fe.read()
        seconds = time.monotonic() - t0
        with open(self.log, "a") as log:
            log.write(f"=== {name}: {' '.join(cmd)}\n{out}{err}=== {name}: "
                      f"{'stopped at its limit' if rc is None else f'exit {rc}'} after {seconds:.1f} s\n")
        return {"rc": rc, "out": out, "err": err, "seconds": seconds, "watched": watched}

    def overrides(self, name: str, resnet_fast: bool = True) -> List[str]:
        """Every training row's overrides: its own run folder, no progress bar or TensorBoard; the device and images
        (on a GPU, the archive; in a dry run, toy synthetic ones)."""
        mine = [f"run_dir={self.work / name}", "log.progress=false", "log.tensorboard=false"]
        if self.dry:
            return ["device=cpu", *DRY_DATA, *(DRY_MODEL if resnet_fast else []), "compile=false", *mine]
        return ["device=cuda", f"data.root={self.data}", *mine]

    def train(self, name: str, extra: List[str], limit: float, env: Optional[Dict[str, str]] = None,
              config: Path = CONFIG, launcher: Tuple[str, ...] = (), **kw: Any) -> Tuple[Dict[str, Any], List[dict]]:
        """``train.py -c config`` with the probes of ``env`` (see :func:`child_main`); returns the process's result
        and the run's metrics rows."""
        over = self.overrides(name, resnet_fast=config == CONFIG)
        if self.dry and "compile=true" in extra:
            extra = [*extra, "compile=false"]  # Inductor's CPU build would take minutes
        cmd = [self.py, *launcher, "-m", HERE, "--child", "-c", str(config), *over, *extra]
        r = self.spawn(name, cmd, limit, env, **kw)
        return r, _metrics(self.work / name)


class Forked:
    """``python -m bench.NAME ARGS`` as a forked child of this process (``runpy`` runs the module's file as
    ``__main__``, as ``-m`` does), with its own session, environment, stdout and stderr; as much of ``Popen`` as the
    check uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``returncode``)."""

    def __init__(self, argv: List[str], env: Dict[str, str], out: Any, err: Any):
        sys.stdout.flush(), sys.stderr.flush()
        self.returncode: Optional[int] = None
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            code = 1
            try:
                os.setsid()
                os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
                # Python's streams onto the new descriptors (whatever they were: a test's capture, say)
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
                os.environ.update(env)
                os.chdir(ROOT)
                script = str(ROOT / (argv[1].replace(".", "/") + ".py"))  # argv: -m bench.NAME ARGS
                sys.argv = [script, *argv[2:]]  # as `python -m bench.NAME ARGS` sets them
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as e:  # sys.exit(None | int | message), as the interpreter reports it
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"child {self.pid}", timeout or 0)
            time.sleep(0.005)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group this check started (torchrun's workers too), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _metrics(run_dir: Path) -> List[dict]:
    from visattn.rundir import metrics_rows

    path = run_dir / "metrics.jsonl"
    return [row for _, row in metrics_rows(path)] if path.is_file() else []


def _last_line(r: Dict[str, Any]) -> str:
    """The line that says why a child failed: visattn's first one-line ``error: ...`` (under torchrun, the worker's,
    before the launcher's report), else a traceback's last ``SomeError: ...``, else the last line."""
    lines = [ln.strip() for ln in (r["err"] + "\n" + r["out"]).splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("error: ")]
    raised = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b[^:]*: ", ln)]
    return (said[0] if said else raised[-1] if raised else lines[-1] if lines else "no output")[:300]


def failed(r: Dict[str, Any], why: str = "") -> Dict[str, Any]:
    if r["rc"] is None:
        return {"status": "timed out", "detail": f"stopped at its limit after {r['seconds']:.0f} s"}
    return {"status": "fail", "detail": why or f"exit {r['rc']}: {_last_line(r)}"}


def short(epochs: int) -> List[str]:
    """A short run of the GPU recipe: ``epochs`` epochs, its warmup the recipe's 23% of them (its 2.3 epochs
    would outlast the run)."""
    return [f"train.epochs={epochs}", f"sched.warmup_epochs={0.23 * epochs:g}"]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def trained(c: Check, r: Dict[str, Any], rows: List[dict], epochs: int = 1, checks: Tuple[Tuple[bool, str], ...] = (),
            said: str = "") -> Dict[str, Any]:
    """A training row's verdict: exit 0, ``epochs`` metrics rows with finite losses, no non-finite step, a finite
    validation accuracy (on the real images, above chance), and the row's own ``checks`` ((ok, what failed))."""
    if r["rc"] != 0:
        return failed(r)
    if [row.get("epoch") for row in rows] != list(range(1, epochs + 1)):
        return {"status": "fail", "detail": f"metrics rows for epochs {[row.get('epoch') for row in rows]}, not 1-{epochs}"}
    last = rows[-1]
    acc = last.get("val_acc")
    problems = [what for ok, what in ((all(_finite(row.get("train_loss")) for row in rows), "a non-finite loss"),
                                      (all(row.get("nonfinite_steps") == 0 for row in rows), "non-finite steps"),
                                      (_finite(acc), "no validation accuracy"),
                                      (c.dry or (_finite(acc) and acc > 0.2), f"validation {acc} is near chance"),
                                      *checks) if not ok]
    speed = "" if c.dry else f", {last['images_per_s']:,.0f} images/s"
    detail = f"val {100 * acc:.2f}% after {epochs} epoch(s){speed}" if _finite(acc) else "no validation"
    detail += f"; {said}" if said else ""
    return {"status": "fail" if problems else "pass", "detail": detail + "".join(f"; FAILED: {p}" for p in problems),
            "val_acc": acc, "images_per_s": last.get("images_per_s"), "epoch_seconds": last.get("epoch_seconds")}


# ------------------------------------------------------------------------------------------------ the rows


def row_data(c: Check, limit: float) -> Dict[str, Any]:
    if c.dry:
        return {"status": "skipped on the CPU", "detail": "dry run: synthetic images, nothing to decode"}
    r = c.spawn("data", [c.py, "-m", HERE, "--decode", c.data], limit)
    if r["rc"] != 0:
        return failed(r)
    return {"status": "pass", "detail": f"{r['out'].strip().splitlines()[-1]} in {r['seconds']:.0f} s"}


def row_race(c: Check, limit: float) -> Dict[str, Any]:
    from visattn.results import read_json

    out = c.out / "gpu_race.json"
    args = DRY_RACE if c.dry else ["--runs", str(c.runs), "--data-root", c.data, "--device", "cuda"]
    r = c.spawn("race", [c.py, "-m", "bench.gpu_race", "--out", str(out), *args], limit)
    if not out.is_file():
        return failed(r)
    return race_row(read_json(out), r["rc"] is None, c.dry)


def race_row(race: Dict[str, Any], timed_out: bool, dry: bool) -> Dict[str, Any]:
    """The race's row from ``gpu_race.json`` (complete, or as far as it got)."""
    runs = race.get("runs", [])
    acc = {k: [round(100 * x["final_val_acc"], 2) for x in runs if x["recipe"] == k] for k in ("visattn", "airbench94")}
    n = min(len(acc["visattn"]), len(acc["airbench94"]))
    ratio, med = race.get("ratio_visattn_over_airbench94"), race.get("median_seconds_to_target") or {}
    compile_s = [x["compile_seconds"] for x in runs if x["recipe"] == "visattn"]
    again = sum(x.get("graphs_compiled_in_training", 0) for x in runs)
    if dry:
        said = f"{n} run(s) each on the CPU (toy size; times are not a claim)"
    else:
        said = "visattn / airbench94 = " + ("n/a (90% not reached)" if ratio is None else f"**{ratio:.2f}**") + (
            f" (median time to 90%: {_secs(med.get('visattn'))} vs {_secs(med.get('airbench94'))}, {n} runs each)")
    said += (f"; val % visattn {', '.join(map(str, acc['visattn']))}; airbench94 {', '.join(map(str, acc['airbench94']))}"
             f"; compile {', '.join(f'{s:.0f}' for s in compile_s)} s apart, {again} graph(s) compiled in training")
    status = "pass" if race.get("complete", True) and n >= 1 else "timed out" if timed_out else "partial"
    return {"status": status, "detail": said, "ratio": ratio, "median_seconds_to_target": med, "val_acc": acc,
            "compile_seconds": compile_s, "graphs_compiled_in_training": again, "device": race.get("device")}


def _secs(s: Optional[float]) -> str:
    return "not reached" if s is None else f"{s:.2f} s"


def row_bf16_compile(c: Check, limit: float) -> Dict[str, Any]:
    r, rows = c.train("bf16_compile", ["precision=bf16", "compile=true", *short(1)], limit)
    return trained(c, r, rows, said="compile off on the CPU" if c.dry else "compiled")


def row_fp16_overflow(c: Check, limit: float) -> Dict[str, Any]:
    report = c.work / "fp16_overflow.json"
    r, rows = c.train("fp16_overflow", ["precision=fp16", "compile=false", *short(1)], limit,
                      env={"GPU_CHECK_OVERFLOW_AT": str(OVERFLOW_AT), "GPU_CHECK_REPORT": str(report)})
    p = _report(report)
    skipped = rows[0].get("skipped_steps", 0) if rows else 0
    checks = ((p.get("weights_unchanged") is True, "the forced step changed the weights"),
              (_finite(p.get("scale_after")) and p["scale_after"] < p.get("scale_before", 0), "the scale did not back off"),
              (skipped >= 1, "no skipped step counted"))
    said = (f"step {OVERFLOW_AT} forced to overflow: weights unchanged {p.get('weights_unchanged')}, scale "
            f"{p.get('scale_before')} -> {p.get('scale_after')}; {skipped} skipped step(s) counted")
    return dict(trained(c, r, rows, checks=checks, said=said), skipped_steps=skipped, probe=p)


def row_channels_last(c: Check, limit: float) -> Dict[str, Any]:
    report = c.work / "channels_last.json"
    r, rows = c.train("channels_last", ["channels_last=true", "compile=false", *short(1)], limit,
                      env={"GPU_CHECK_LAYOUT": "1", "GPU_CHECK_REPORT": str(report)})
    p = _report(report)
    checks = ((p.get("input_channels_last") is True, "batches not channels_last"),
              (p.get("weights_channels_last") is True, "convolution weights not channels_last"),
              ((p.get("argmax_agreement") or 0) >= 0.98, "logits differ from a contiguous copy's"))
    said = (f"batches and weights channels_last: {p.get('input_channels_last')}, {p.get('weights_channels_last')}; "
            f"a contiguous copy agrees on {100 * (p.get('argmax_agreement') or 0):.1f}% of the predictions "
            f"(largest logit difference {p.get('max_logit_diff', float('nan')):.3g})")
    return dict(trained(c, r, rows, checks=checks, said=said), probe=p)


def row_sigterm_resume(c: Check, limit: float) -> Dict[str, Any]:
    from visattn.rundir import load_checkpoint

    steps, name, extra = c.work / "sigterm_steps.log", "sigterm_resume", ["compile=false", *short(2)]
    steps.write_text("")
    end = time.monotonic() + limit
    first_end = time.monotonic() + limit * 0.5  # half the row's time for the run to be stopped, half to resume it

    def interrupt(proc: subprocess.Popen) -> Optional[int]:
        while proc.poll() is None and time.monotonic() < first_end:
            logged = steps.read_text().split()
            if logged and int(logged[-1]) >= SIGTERM_AT:
                proc.send_signal(signal.SIGTERM)
                return int(logged[-1])
            time.sleep(0.002)
        return None

    first, _ = c.train(name, extra, limit * 0.5, env={"GPU_CHECK_STEP_LOG": str(steps)}, watch=interrupt)
    ckpt = c.work / name / "last.pt"
    if first["watched"] is None or first["rc"] != 128 + signal.SIGTERM or "stopped by SIGTERM; state saved" not in \
            first["err"] or not ckpt.is_file():
        why = "the run ended before the signal" if first["watched"] is None else f"exit {first['rc']}: {_last_line(first)}"
        return failed(first, f"SIGTERM at step {first['watched']}: {why}")
    saved = load_checkpoint(ckpt, map_location="cpu")
    second, rows = c.train(name, [*extra, "resume=auto"], end - time.monotonic())
    total = sum(row.get("epoch_steps", 0) for row in rows)
    checks = (("resumed from" in second["out"], "no 'resumed from' line"),
              (bool(rows) and rows[-1].get("step") == total, f"ended at step {rows[-1].get('step') if rows else None}, "
                                                              f"not {total}"))
    said = (f"SIGTERM at step {first['watched']}: exit 143, saved at step {saved['step']} "
            f"({saved['loader']['position']} batches into epoch {saved['loader']['epoch'] + 1}); resumed to step {total}")
    return dict(trained(c, second, rows, epochs=2, checks=checks, said=said), signalled_at=first["watched"],
                saved_step=int(saved["step"]))


def row_maps_autocast(c: Check, limit: float) -> Dict[str, Any]:
    name = "maps_autocast"
    r, rows = c.train(name, ["model.attention=cbam", "precision=bf16", "compile=false", *short(1),
                             "log.tensorboard=true", "log.maps_every=1", "log.faithfulness=true",
                             *(["log.probe_size=2"] if c.dry else [])], limit)
    tb = _tensorboard(c.work / name / "tb") if r["rc"] == 0 else {}
    checks = ((tb.get("map_images", 0) > 0, "no maps/ image in TensorBoard"),
              (tb.get("images_decoded") is True, "a map image does not decode"),
              (tb.get("faithfulness_finite") is True, "no finite faithfulness/ scalars"))
    said = (f"{tb.get('map_images', 0)} maps/ images ({tb.get('map_tags', 0)} tags), "
            f"{tb.get('faithfulness_scalars', 0)} faithfulness/ scalars, all finite: {tb.get('faithfulness_finite')}")
    return dict(trained(c, r, rows, checks=checks, said=said), tensorboard=tb)


def _tensorboard(logdir: Path) -> Dict[str, Any]:
    """What a run logged: its maps/ images (each decoded) and its faithfulness/ scalars."""
    import io

    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={IMAGES: 0, SCALARS: 0})
    acc.Reload()
    tags = acc.Tags()
    maps = [t for t in tags.get("images", []) if t.startswith("maps/")]
    images = [e for t in maps for e in acc.Images(t)]
    sizes = [Image.open(io.BytesIO(e.encoded_image_string)).size for e in images]
    faith = [s.value for t in tags.get("scalars", []) if t.startswith("faithfulness/") for s in acc.Scalars(t)]
    return {"map_tags": len(maps), "map_images": len(images), "images_decoded": all(w * h > 0 for w, h in sizes),
            "faithfulness_scalars": len(faith), "faithfulness_finite": bool(faith) and all(map(math.isfinite, faith))}


def row_torchrun_nccl(c: Check, limit: float) -> Dict[str, Any]:
    report = c.work / "torchrun.json"
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1")
    r, rows = c.train("torchrun_nccl", ["compile=false", *short(1)], limit, launcher=launcher,
                      env={"GPU_CHECK_FORCE_DIST": "1", "GPU_CHECK_REPORT": str(report)})
    p, want = _report(report), "gloo" if c.dry else "nccl"
    checks = ((p.get("backend") == want, f"backend {p.get('backend')}, not {want}"),
              (p.get("world_size") == 1 and p.get("data_parallel") is True, "the data-parallel path did not run"))
    said = f"process group {p.get('backend')} over {p.get('world_size')} rank(s), DDP" + (" (gloo on the CPU)" if c.dry else "")
    return dict(trained(c, r, rows, checks=checks, said=said), probe=p)


TARGET_BLOCKS = ("se", "eca", "gc", "spatial", "cbam", "coord", "nonlocal", "mhsa2d")  # bench/blocks.py TARGETS


def row_blocks(c: Check, limit: float) -> Dict[str, Any]:
    """``bench/blocks.py`` on CUDA: every block against ``none`` in the recipe's training step at its batch, eager
    (compiling 17 networks would not fit the row's minute and a half), 5 interleaved repeats of 5 steps, the blocks
    before issue 70 (``--prepare``'s copy in ``data/gpu_check/before``: the device's tree has no git history) and
    now; the JSON beside the others. The dry run: ``--quick`` on the CPU."""
    before = ROOT / "data" / "gpu_check" / "before"
    only = ["--only", *TARGET_BLOCKS]  # the issue-70 blocks: all 28 would not fit the row's minute and a half
    if c.dry:
        args = ["--device", "cpu", "--quick", *only]
    else:
        args = ["--device", "cuda", "--no-compile", "--repeats", "5", "--steps", "5", *only,
                *(["--before", str(before)] if before.is_dir() else [])]
    r = c.spawn("blocks", [c.py, "-m", "bench.blocks", *args, "--out", str(c.out / "block_speed.json")], limit)
    if r["rc"] != 0:
        return failed(r)
    table = "\n".join(ln for ln in r["out"].splitlines() if ln.startswith("|"))
    return {"status": "pass", "table": table, "detail": f"{len(table.splitlines()) - 2} rows (table in the JSON); "
            f"{r['seconds']:.0f} s" + ("; dry run: times are not a claim" if c.dry else "")}


def row_timm(c: Check, limit: float) -> Dict[str, Any]:
    """A timm model through ``train.py`` on a base config whose model section names none of resnet_fast's options."""
    import yaml

    from visattn.config import read_yaml

    base = c.work / "timm_base.yaml"
    data = read_yaml(CONFIG)["data"]
    base.write_text(yaml.safe_dump({
        "name": "gpu_check_timm", "precision": "bf16", "channels_last": True, "compile": False, "data": data,
        "model": {"name": "resnet_fast"}, "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
        "sched": {"name": "onecycle", "warmup_epochs": 0.3}, "train": {"epochs": 1, "batch_size": 512,
                                                                       "label_smoothing": 0.1},
        "eval": {"batch_size": 1000, "tta": "flip"}, "log": {"maps_every": 0}}))
    extra = ["model.name=timm/resnet18", "model.cifar_stem=true", "model.attention=cbam"]
    # a dry run's resnet18 at 8 px on 40 images, in fp32 (bf16 without native support crawls on a CPU)
    dry = ["data.image_size=8", "data.synthetic_size=60", "data.val_size=20", "train.batch_size=20",
           "eval.batch_size=20", "eval.tta=none", "precision=fp32"] if c.dry else []
    r, rows = c.train("timm", [*extra, *dry], limit, config=base)
    if r["rc"] == 2 and "unknown model" in r["err"] and "timm/" in r["err"]:
        return {"status": "not available", "detail": "visattn refuses `model.name=timm/resnet18` as an unknown model "
                                                     "(the foreign-model work is not in this revision)"}
    return trained(c, r, rows, said="timm resnet18, CIFAR stem, CBAM inserted")


def _report(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


ROWS: Dict[str, Callable[[Check, float], Dict[str, Any]]] = {
    "data": row_data, "race": row_race, "bf16_compile": row_bf16_compile, "fp16_overflow": row_fp16_overflow,
    "channels_last": row_channels_last, "sigterm_resume": row_sigterm_resume, "maps_autocast": row_maps_autocast,
    "torchrun_nccl": row_torchrun_nccl, "blocks": row_blocks, "timm": row_timm}


# ------------------------------------------------------------------------ the child: train.py with the probes


def child_main(argv: List[str]) -> int:
    """``train.py ARGV`` (``visattn.cli.main``) with the probes the environment asks for, each a hook of the loop
    (:func:`visattn.hooks.register_hook`); each writes what it saw to ``GPU_CHECK_REPORT`` (rank 0).
    ``GPU_CHECK_STEP_LOG``: every step's number, appended as it ends. ``GPU_CHECK_OVERFLOW_AT=K``: the fp16
    scaler's K-th scaled loss is made infinite. ``GPU_CHECK_LAYOUT``: the batches' and weights' memory format, and
    the logits against a contiguous copy after training. ``GPU_CHECK_FORCE_DIST``: the data-parallel path under
    torchrun even with one rank (``VISATTN_DATA_PARALLEL=1``; the trainer takes it from two ranks on), so DDP and
    the process group's all-reduce run."""
    from visattn import cli
    from visattn.hooks import register_hook

    report: Dict[str, Any] = {}
    env = os.environ
    hooks: List[Tuple[str, Callable]] = []
    if env.get("GPU_CHECK_STEP_LOG"):
        hooks.append(("step_end", _step_log(env["GPU_CHECK_STEP_LOG"])))
    if env.get("GPU_CHECK_OVERFLOW_AT"):
        hooks.append(("fit_start", _overflow_probe(int(env["GPU_CHECK_OVERFLOW_AT"]), report)))
    if env.get("GPU_CHECK_LAYOUT"):
        hooks += _layout_probe(report)
    if env.get("GPU_CHECK_FORCE_DIST"):
        env["VISATTN_DATA_PARALLEL"] = "1"
        hooks.append(("fit_start", _dist_probe(report)))
    with contextlib.ExitStack() as stack:
        for event, hook in hooks:
            stack.callback(register_hook(event, hook))
        try:
            return cli.main(argv)
        finally:
            _close_group()
            if env.get("GPU_CHECK_REPORT") and env.get("RANK", "0") == "0":
                Path(env["GPU_CHECK_REPORT"]).write_text(json.dumps(report, indent=1))


def _step_log(path: str) -> Callable:
    """A ``step_end`` hook that appends each step's number to ``path``."""
    def logged(run: Any, step: int) -> None:
        with open(path, "a") as f:
            f.write(f"{step}\n")
    return logged


def _forced_overflow(at: int, report: Dict[str, Any]) -> Callable:
    """A ``make_scaler`` of the same signature: fp16 gets a GradScaler whose ``at``-th scaled loss is infinite (so
    are the gradients), and which records whether that step left the weights as they were and the scale backed
    off; other precisions get none."""
    import torch

    class ForcedOverflow(torch.amp.GradScaler):
        calls = 0

        def scale(self, outputs):  # type: ignore[override]
            self.calls += 1
            out = super().scale(outputs)
            return out * float("inf") if self.calls == at else out

        def step(self, optimizer, *args, **kwargs):  # type: ignore[override]
            if self.calls != at:
                return super().step(optimizer, *args, **kwargs)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            before = [p.detach().clone() for p in params]
            report["scale_before"] = self.get_scale()
            out = super().step(optimizer, *args, **kwargs)
            report["weights_unchanged"] = all(torch.equal(b, p) for b, p in zip(before, params))
            return out

        def update(self, new_scale=None):  # type: ignore[override]
            super().update(new_scale)
            if self.calls == at:
                report["scale_after"] = self.get_scale()

    return lambda device, precision: ForcedOverflow(device.type) if precision == "fp16" else None


def _overflow_probe(at: int, report: Dict[str, Any]) -> Callable:
    """A ``fit_start`` hook: an fp16 run's scaler becomes :func:`_forced_overflow`'s (its state carried over)."""
    make = _forced_overflow(at, report)

    def start(run: Any) -> None:
        if run.opt.scaler is not None:
            forced = make(run.device, run.policy.precision)
            forced.load_state_dict(run.opt.scaler.state_dict())
            run.opt.scaler = forced
    return start


def _layout_probe(report: Dict[str, Any]) -> List[Tuple[str, Callable]]:
    """``fit_start``: the weights' layout, and a forward pre-hook that records the first training batch's;
    ``fit_end``: the trained model's logits on a held-out batch against a contiguous copy's."""
    import copy

    import torch

    from visattn.evaluate import autocast

    cl = torch.channels_last

    def first_batch(module: Any, args: tuple) -> None:
        if module.training:
            report.setdefault("input_channels_last", bool(args[0].is_contiguous(memory_format=cl)))

    def start(run: Any) -> None:
        convs = [p for p in run.model.parameters() if p.dim() == 4]
        report["weights_channels_last"] = bool(convs) and all(p.is_contiguous(memory_format=cl) for p in convs)
        run.model.register_forward_pre_hook(first_batch)

    def end(run: Any) -> None:
        x, _ = next(iter(run.eval_loader))
        model = run.eval_model.eval()
        plain = copy.deepcopy(model).to(memory_format=torch.contiguous_format)
        with torch.no_grad(), autocast(run.device, run.policy.precision):
            a, b = model(x.contiguous(memory_format=cl)).float(), plain(x.contiguous()).float()
        report.update(argmax_agreement=(a.argmax(1) == b.argmax(1)).float().mean().item(),
                      max_logit_diff=(a - b).abs().max().item())

    return [("fit_start", start), ("fit_end", end)]


def _dist_probe(report: Dict[str, Any]) -> Callable:
    """A ``fit_start`` hook that records the process group and whether the run took the data-parallel path."""
    import torch.distributed as dist

    def start(run: Any) -> None:
        up = dist.is_initialized()
        report.update(backend=dist.get_backend() if up else None, world_size=dist.get_world_size() if up else None,
                      data_parallel=run.dist.enabled)
    return start


def _close_group() -> None:
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def decode(root: str) -> None:
    """``--decode ARCHIVE``: the GPU recipe's images into visattn's cache, so later rows read them from there."""
    from visattn.config import load_config
    from visattn.data import load_splits

    splits = load_splits(load_config(CONFIG, [f"data.root={root}"]).data, 0)
    print(f"{len(splits.train):,} training and {len(splits.eval):,} held-out images decoded into the cache")


# ---------------------------------------------------------------------------------- the check, its JSON, its table


def environment(dry: bool) -> Dict[str, Any]:
    """Device, library versions, date and revision (``data/gpu_check/REVISION`` where the tree has no git)."""
    import timm
    import torch

    from visattn.results import git_revision

    cuda = not dry and torch.cuda.is_available()  # a dry run never initialises CUDA: it forks its children
    rev = git_revision()
    held = ROOT / "data" / "gpu_check" / "REVISION"
    if rev == "unknown" and held.is_file():
        rev = held.read_text().strip()
    return {"device": torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})",
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "timm": timm.__version__, "python": platform.python_version(), "git": rev, "dry": dry,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def run_rows(c: Check, names: List[str], result: Dict[str, Any], write: Callable[[], None],
             rows: Optional[Dict[str, Callable]] = None) -> None:
    """Each row in order under its time guard; the JSON is rewritten after each. A row that raises is a fail
    row (its traceback in the log), never the end of the check."""
    import traceback

    rows = ROWS if rows is None else rows
    for name in names:
        limit = min(CAPS.get(name, 60), c.left()) if not c.dry else c.left()
        t0 = time.monotonic()
        print(f"--- {name}: {WHAT.get(name, name)} ({c.left():.0f} s of the budget left)", flush=True)
        if limit < (0 if c.dry else MIN_START) or limit <= 0:
            row = {"status": "not run", "detail": f"{max(c.left(), 0):.0f} s of the budget left"}
        else:
            try:
                row = rows[name](c, limit)
            except Exception as e:  # the check goes on; the row says what broke
                with open(c.log, "a") as log:
                    log.write(f"=== {name}: {traceback.format_exc()}")
                row = {"status": "fail", "detail": f"{e.__class__.__name__}: {str(e)[:300]}"}
        result["rows"].append({"name": name, "what": WHAT.get(name, name), **row,
                               "seconds": round(time.monotonic() - t0, 1)})
        write()
        print(f"    {row['status']}: {row['detail']}", flush=True)


def summary(result: Dict[str, Any]) -> str:
    """The lines printed at the end: the device, then one line per row in order of importance."""
    head = (f"GPU check{' (DRY RUN on the CPU: toy sizes, no timing claims)' if result.get('dry') else ''}: "
            f"{result['device']}, torch {result['torch']}, CUDA {result['cuda']}, {result['date']}, git {result['git']}")
    width = max([len(r["name"]) for r in result["rows"]] + [4])
    lines = [f"{r['name']:<{width}}  {r['status']:<18} {r['detail']} ({r['seconds']:.0f} s)" for r in result["rows"]]
    return "\n".join([head, *lines])


# what --table and --merge read of a check's JSON (bench.common.read_results): anything else is one line, exit 2
TABLE_HEAD = {"device": "str", "torch": "str", "cuda": "str?", "date": "str", "git": "str", "dry": "bool?"}
TABLE_ROW = {"name": "str", "status": "str", "detail": "str", "what": "str?"}


def table(result: Dict[str, Any]) -> str:
    """The docs' GPU table (docs/results.md#gpu) from a check's JSON."""
    head = (f"On {result['device']} (torch {result['torch']}, CUDA {result['cuda']}), {result['date'][:10]}, "
            f"git {result['git'][:12]}{', a dry run on the CPU' if result.get('dry') else ''}: `bash bench/gpu_check.sh`")
    lines = [head, "", "| check | what | result | detail |", "|---|---|---|---|"]
    for r in result["rows"]:
        detail = str(r["detail"]).replace("|", "/")
        lines.append(f"| `{r['name']}` | {r.get('what', WHAT.get(r['name'], ''))} | {r['status']} | {detail} |")
    return "\n".join(lines)


def merge(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Several checks' JSON as one (a rerun of some rows after the first call): each row from the last file that
    has it, in the rows' order; the device, versions and date of the last file, the files' dates kept."""
    rows = {r["name"]: r for result in results for r in result["rows"]}
    order = [n for n in ROWS if n in rows] + [n for n in rows if n not in ROWS]
    return {**results[-1], "merged_from": [r.get("date") for r in results], "rows": [rows[n] for n in order]}


def main() -> None:
    from visattn.results import write_atomic

    ap = parser(__doc__, out=ROOT / "runs" / "gpu_check", help={"out": "where the JSON and the log go"})
    ap.add_argument("--data", default="data/gpu_check/cifar10-train-jpeg.tar.gz", help="the images' archive")
    ap.add_argument("--dry", action="store_true", help="on the CPU at a toy size, no timing claims")
    ap.add_argument("--budget", type=float, default=430.0, help="seconds for every row together")
    ap.add_argument("--runs", type=int, default=3, help="the race's runs of each recipe")
    ap.add_argument("--only", nargs="*", choices=list(ROWS), default=None, help="these rows only (a rerun)")
    ap.add_argument("--table", type=Path, nargs="+", default=None, metavar="JSON",
                    help="print the docs' table of a check's JSON (of several: merged, as --merge)")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="print one JSON of several (a rerun's rows replace the first call's)")
    a = ap.parse_args()
    if a.table is not None or a.merge is not None:
        merged = merge([read_results(p, TABLE_HEAD, "rows", TABLE_ROW) for p in (a.table or a.merge)])
        print(table(merged) if a.table is not None else json.dumps(merged, indent=1))
        return
    if a.budget <= 0 or a.runs < 1:
        sys.exit("error: --budget must be positive and --runs at least 1")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_check.log").write_text("")
    result = {**environment(a.dry), "command": command(),
              "budget_seconds": a.budget, "rows": []}
    print(f"GPU check on {result['device']}, torch {result['torch']}, CUDA {result['cuda']}; budget {a.budget:.0f} s",
          flush=True)
    if a.dry:  # what the forked children need, imported once here
        import visattn.cli  # noqa: F401
        import visattn.trainer  # noqa: F401
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        c = Check(a.out, Path(work), a.data, a.dry, a.budget, a.runs)
        run_rows(c, a.only or list(ROWS), result,
                 lambda: write_atomic(a.out / RESULTS, json.dumps(result, indent=1) + "\n"))
    print("\n" + summary(result))
    print(f"wrote {a.out / RESULTS}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child_main(sys.argv[2:]))
    if sys.argv[1:2] == ["--decode"]:
        decode(sys.argv[2])
        sys.exit(0)
    from visattn.errors import run_main

    run_main(main, "gpu_check.py")
