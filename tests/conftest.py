"""Shared fixtures: where the real CIFAR-10 images are, small synthetic configs, a command run in-process."""
from __future__ import annotations

import contextlib
import ctypes
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import pytest
import torch

from visattn.attention import AttentionTap
from visattn.cli import main as train_main
from visattn.maps import colorize

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
TIMING = {"images_per_s", "epoch_seconds", "wall_seconds", "eval_seconds"}  # metrics that vary run to run


@pytest.fixture(scope="session", autouse=True)
def allocator_left_alone() -> Iterator[None]:
    """``train.py``, ``bench.blocks`` and ``bench.cpu_heap`` set glibc's allocator for the process they run in
    (``cpu_heap: keep``, visattn/cpu_heap.py); called in this process they leave the test session's as it is (tests of
    the setting itself run it in processes of their own)."""
    from visattn import cpu_heap

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_heap, "keep_freed_memory", lambda: False)
        yield


def metrics_rows(run_dir: Path) -> List[Dict]:
    """The run's metrics.jsonl rows without the timing fields (for comparing two runs exactly)."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def real_data_path() -> Path | None:
    """The JPEG CIFAR-10 archive: $VISATTN_CIFAR10, else ../shared/data beside the checkout."""
    env = os.environ.get("VISATTN_CIFAR10")
    cands = [Path(env)] if env else []
    cands.append(ROOT.parent / "shared" / "data" / "cifar10-train-jpeg.tar.gz")
    for p in cands:
        if p.exists():
            return p
    return None


@pytest.fixture(scope="session")
def cifar10_path() -> Path:
    p = real_data_path()
    if p is None:
        pytest.skip("real CIFAR-10 images not found: set VISATTN_CIFAR10 or place cifar10-train-jpeg.tar.gz in ../shared/data")
    return p


# the shared finished run: one epoch of the smoke config on tiny synthetic data, EMA and TensorBoard on (so its
# checkpoints hold an ``ema`` entry and its folder a ``tb``), made once per session
FINISHED = ["data.synthetic_size=400", "data.val_size=100", "model.widths=[8,16,16]", "model.stem_width=8",
            "model.attention=none", "log.progress=false", "log.maps_every=0", "device=cpu", "eval.tta=none",
            "precision=fp32", "train.batch_size=50", "train.epochs=1", "train.ema_decay=0.9"]


def folder_digest(folder: Path) -> Dict[str, str]:
    """Every file under ``folder`` (relative path) and the SHA-256 of its bytes."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Iterator[Path]:
    """A finished run (``FINISHED``) the bad-input, fuzz and hostile tests read; none may change its files: the
    session fails at its end if one did. Copy it to change it."""
    from visattn.config import load_config
    from visattn.trainer import run

    rd = tmp_path_factory.mktemp("finished") / "run"
    run(load_config(SMOKE, [f"run_dir={rd}", *FINISHED]), log=lambda *a, **k: None)
    before = folder_digest(rd)
    yield rd
    assert folder_digest(rd) == before, f"a test changed the shared finished run {rd}"


@pytest.fixture(scope="session")
def pre_digest_best(tmp_path_factory) -> Path:
    """A checkpoint written by visattn before checkpoints carried a digest, made from the repository's history
    (tests/old_revisions.py)."""
    from old_revisions import pre_digest_checkpoint

    return pre_digest_checkpoint(tmp_path_factory.mktemp("pre_digest"))


@pytest.fixture(scope="session")
def pre89_folders(tmp_path_factory) -> Path:
    """Run folders made, and resumed, by the trainer before issue 89's split (tests/old_revisions.py)."""
    from old_revisions import pre89_folders as make

    return make(tmp_path_factory.mktemp("pre89"))


@pytest.fixture
def tiny_overrides(tmp_path):
    """Overrides that make any config a seconds-long synthetic run in a temporary run dir."""
    return [
        f"run_dir={tmp_path / 'run'}",
        "data.source=synthetic",
        "data.synthetic_size=240",
        "data.val_size=40",
        "train.batch_size=40",
        "eval.batch_size=100",
        "log.progress=false",
    ]


@contextmanager
def recording(module: torch.nn.Module) -> Iterator[list]:
    """Attach one sink to every tap under ``module`` (what a recorder does, without visattn.maps); yields
    the list of records, named by module path without the trailing ``.tap``."""
    sink: list = []
    taps = [(name, m) for name, m in module.named_modules() if isinstance(m, AttentionTap)]
    for name, tap in taps:
        tap.sink, tap.record_name = sink, name.removesuffix(".tap")
    try:
        yield sink
    finally:
        for _, tap in taps:
            tap.sink = None


def has_colour_bar(picture: np.ndarray, colormap: str = "jet") -> bool:
    """Some row holds the whole colour map, cold to hot, over at least 150 pixels."""
    lut = colorize(torch.linspace(0, 1, 256), colormap) * 255
    for row in picture[::-1]:  # the bar sits at the bottom
        d = torch.cdist(torch.tensor(row, dtype=torch.float32), lut)
        dist, idx = d.min(1)
        run = idx[dist < 2]
        if len(run) >= 150 and run[0] <= 2 and run[-1] >= 253 and bool((run.diff() >= 0).all()):
            return True
    return False


# ------------------------------------------------------------------------------- a command run in-process

# a fresh interpreter's warnings filters (no -W, no PYTHONWARNINGS), in the order warnings.filters holds them
STARTUP_FILTERS = [("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
                   ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""),
                   ("ignore", ResourceWarning, "")]


def run_cli(argv: Sequence[str], tool: Callable[[List[str]], Optional[int]] = train_main,
            cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A command-line entry point (``train.py``'s ``main`` unless ``tool``) run in-process, as the subprocess
    ``python train.py ARGV`` with ``cwd`` would run it, minus the interpreter start: the exit status (a
    ``SystemExit`` becomes one), and everything written to stdout and stderr, Python's warnings (printed as a
    fresh interpreter prints them) and the file descriptors' own writes included. Any other exception propagates.

    The process-wide state the command may change is put back afterwards: the working folder, ``sys.argv``,
    ``os.environ``, signal handlers, the umask, warnings filters, the root logger, the random generators (Python's,
    NumPy's, torch's), torch's deterministic/cuDNN/thread/dtype/matmul settings and Pillow's pixel limit."""
    argv = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    with kept_process_state(), _fds_captured() as fds, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if os.getcwd() != os.path.realpath(cwd):  # only where it differs: a test run as another user may not enter it
            os.chdir(cwd)
        sys.argv = [str(ROOT / "train.py") if tool is train_main else sys.modules[tool.__module__].__file__, *argv]
        warnings.showwarning = _print_warning
        try:
            rc = tool(argv)
        except SystemExit as e:  # argparse's refusals and --help, or a sys.exit in the tool
            rc = e.code
            if rc is not None and not isinstance(rc, int):  # sys.exit("message"): printed, status 1
                print(rc, file=sys.stderr)
                rc = 1
    return subprocess.CompletedProcess(argv, 0 if rc is None else rc, out.getvalue() + fds[1].getvalue(),
                                       err.getvalue() + fds[2].getvalue())


def _print_warning(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                   line: Optional[str] = None) -> None:
    """What Python prints for a warning, on ``sys.stderr`` as it is now (``warnings.showwarning``'s own default)."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextmanager
def _fds_captured() -> Iterator[Dict[int, io.StringIO]]:
    """File descriptors 1 and 2 point at temporary files meanwhile (writes that bypass ``sys.stdout`` and
    ``sys.stderr``: C libraries, child processes); yields the text written to each, filled in at the end."""
    libc = ctypes.CDLL(None)
    got = {fd: io.StringIO() for fd in (1, 2)}
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    libc.fflush(None)
    saved = {fd: os.dup(fd) for fd in got}
    files = {fd: tempfile.TemporaryFile() for fd in got}
    try:
        for fd, f in files.items():
            os.dup2(f.fileno(), fd)
        yield got
    finally:
        libc.fflush(None)
        for fd, f in files.items():
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
            f.seek(0)
            got[fd].write(f.read().decode(errors="replace"))
            f.close()


@contextmanager
def kept_process_state() -> Iterator[None]:
    """Everything listed in :func:`run_cli`'s docstring as it was on entry, put back on exit (also for a test that
    calls ``run`` itself: ``deterministic=true`` switches torch's deterministic algorithms on for the process)."""
    from PIL import Image

    cwd, argv, environ, mask = os.getcwd(), sys.argv, dict(os.environ), os.umask(0o22)
    os.umask(mask)
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)}
    root = logging.getLogger()
    logger = (root.level, list(root.handlers), logging.root.manager.disable)
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
           torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    det = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    torch_rest = (torch.get_num_threads(), torch.get_default_dtype(), torch.get_float32_matmul_precision(),
                  torch.is_grad_enabled())
    max_pixels = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(STARTUP_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            yield
    finally:
        if os.getcwd() != cwd:
            os.chdir(cwd)
        sys.argv = argv
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
        os.umask(mask)
        for s, h in handlers.items():
            if h is not None and signal.getsignal(s) is not h:
                signal.signal(s, h)
        root.setLevel(logger[0])
        root.handlers[:] = logger[1]
        logging.disable(logger[2])
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if rng[3] is not None:
            torch.cuda.set_rng_state_all(rng[3])
        torch.use_deterministic_algorithms(det[0], warn_only=det[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn
        torch.set_num_threads(torch_rest[0])
        torch.set_default_dtype(torch_rest[1])
        torch.set_float32_matmul_precision(torch_rest[2])
        torch.set_grad_enabled(torch_rest[3])
        Image.MAX_IMAGE_PIXELS = max_pixels


# ---- the fast tier: `make test` runs what is not marked slow; `make test-all` (CI) runs everything -------------
# The blocks' cheap checks (build, shapes, any size, identity start, finiteness, dtypes and layouts, jit.trace,
# double backward, vmap) run for every block in both tiers. The expensive ones (torch.compile with fullgraph,
# torch.export, ONNX through onnxruntime, a whole model's graph breaks, insertion into each trained model family)
# run in the fast tier for these blocks only, one for each code path the others share, and for every block in the
# whole suite:
REPRESENTATIVE_BLOCKS = {
    "none": "the identity: no parameters and no tap, each transform's trivial case",
    "se": "a channel gate: pooled vector, 1x1-conv MLP, sigmoid; a (B, C) tap",
    "spatial": "a spatial gate: a 7x7 conv over channel statistics, BatchNorm; a (B, 1, H, W) tap",
    "cbam": "a channel and a spatial gate in one block, through mean_max (the fused mean and amax)",
    "sk": "a convolution-replacing residual block: conv branches, BatchNorm on pooled vectors, a softmax over paths",
    "nonlocal": "self-attention over a feature map's positions through SDPA; an (HW, HW) token tap",
    "mhsa": "multi-head token self-attention through SDPA",
    "xca": "cross-covariance attention: the (heads, d, d) covariance tap, normalisation in fp32 with autocast off",
    "seqpool": "a pooling head: (B, N, D) tokens to one (B, D) vector; a pool tap",
}


def tiered(names: Sequence[str]) -> list:
    """``names`` as parametrize values: the representative blocks as they are, every other one marked slow."""
    return [n if n in REPRESENTATIVE_BLOCKS else pytest.param(n, marks=pytest.mark.slow) for n in names]


def first_fast(cases: Sequence) -> list:
    """Parametrize ``cases`` (values, or tuples of a test's several arguments): the first as it is, the rest marked
    slow. For refusals that each start a fresh interpreter (a bench script's ``python -m``, about as long as importing
    torch): the fast tier keeps one through each path, the whole suite every one."""
    return [c if i == 0 else pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow)
            for i, c in enumerate(cases)]


# Besides the tests marked in their files, these node ids (or prefixes) are slow: each took over 10 s in a full run
# (`pytest --durations=0`, 2026-12-03). What stays fast still covers each area: the configs' smoke runs keep one
# per family (the rest train a few steps of every other config), a package model trains in fp32 and bf16.
SLOW = (
    "tests/test_bench.py::test_a_killed_sweep_run_goes_on_from_its_checkpoint_or_starts_again",
    "tests/test_bench.py::test_gpu_table_",
    "tests/test_bench.py::test_a_sweep_",
    "tests/test_bench_blocks.py::test_a_quick_run_writes_every_ratio_from_one_process",
    "tests/test_bench_faithfulness.py::test_scores_every_kind_writes_rows_and_reports",
    "tests/test_distributed.py::test_torchrun_two_ranks_agree_count_all_images_and_resume_exactly",
    "tests/test_faults.py::test_kill_9_anywhere_loses_at_most_one_interval_and_resumes_exactly",
    "tests/test_faults.py::test_sigterm_saves_the_current_step_and_exits_143",
    "tests/test_foreign.py::test_placed_objects_on_a_package_model_are_scored_by_the_localization_bench",
    "tests/test_foreign.py::test_each_precision_layout_ema_and_compile_trains_a_package_model[compile]",
    "tests/test_foreign.py::test_each_precision_layout_ema_and_compile_trains_a_package_model[fp16-ema]",
    "tests/test_foreign.py::test_torchrun_trains_a_package_model_on_two_ranks",
    "tests/test_foreign.py::test_resume_continues_a_package_model_exactly",
    "tests/test_foreign.py::test_the_cli_trains_logs_the_blocks_maps_and_evaluate_scores_it",
    "tests/test_gpu_race.py::test_the_race_runs_end_to_end_on_the_cpu_and_writes_its_json",
    "tests/test_reference_airbench.py::test_a_short_run_on_synthetic_images_runs_end_to_end",
    "tests/test_tensorboard_server.py::",
    "tests/test_train.py::test_ema_warms_up",
    "tests/test_train.py::test_compile_on_cpu",
)
FAST_CONFIGS = {"smoke.yaml", "cifar10_cpu.yaml", "attention/resnet_fast_cbam.yaml", "timm/mobilenetv3_small.yaml",
                "vit_tiny.yaml", "placed/resnet_fast_none.yaml"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        nid = item.nodeid
        config_smoke = nid.startswith("tests/test_configs.py::test_config_trains_a_few_steps[")
        if nid.startswith(SLOW) or (config_smoke and nid.split("[", 1)[1][:-1] not in FAST_CONFIGS):
            item.add_marker(pytest.mark.slow)
