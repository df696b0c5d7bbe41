"""Knowledge distillation (``train.distill``): the loss, the teacher's checks, and a student that learns from it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from visattn.cli import main
from visattn.config import load_config
from visattn.distill import Distill, distill_loss
from visattn.errors import CheckpointError, ConfigError
from visattn.models import create_model
from visattn.rundir import load_checkpoint, save_checkpoint
from visattn.step import StepPolicy, training_loss
from visattn.trainer import run

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["log.progress=false", "log.tensorboard=false", "log.maps_every=0", "model.attention=none", "eval.tta=none",
         "data.synthetic_size=700", "data.val_size=200", "data.image_size=16", "model.widths=[8,16,32]",
         "model.stem_width=8"]


def _cfg(run_dir: Path, *extra: str):
    return load_config(ROOT / "configs" / "smoke.yaml", [f"run_dir={run_dir}", *QUIET, *extra])


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A smoke-sized CNN trained 3 epochs on the synthetic images: well above chance."""
    rd = tmp_path_factory.mktemp("teacher") / "run"
    summary = run(_cfg(rd, "train.epochs=3"), log=lambda *a: None)
    assert summary["best_val_acc"] > 0.5
    return rd / "last.pt"


def test_soft_term_is_zero_for_equal_logits_and_positive_otherwise():
    torch.manual_seed(0)
    s, t = torch.randn(16, 10), torch.randn(16, 10)
    assert distill_loss(s, s.clone(), "soft", 2.0).abs() < 1e-6
    assert distill_loss(s, t, "soft", 1.0) > 0.05
    # the KL divergence of the tempered softmaxes, times T^2
    ref = F.kl_div(F.log_softmax(s / 4, 1), F.softmax(t / 4, 1), reduction="batchmean") * 16
    assert torch.allclose(distill_loss(s, t, "soft", 4.0), ref, atol=1e-6)


def test_hard_term_is_cross_entropy_against_the_teachers_top_class():
    torch.manual_seed(0)
    s, t = torch.randn(16, 10), torch.randn(16, 10)
    assert torch.allclose(distill_loss(s, t, "hard"), F.cross_entropy(s, t.argmax(1)))


def test_training_loss_mixes_the_terms_and_leaves_the_teacher_untouched():
    torch.manual_seed(0)
    student = create_model("resnet_fast", num_classes=10, widths=[8, 16, 16], stem_width=8)
    teacher = create_model("resnet_fast", num_classes=10, widths=[8, 16, 16], stem_width=8).eval()
    teacher.requires_grad_(False)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    dev = torch.device("cpu")
    logits = student(x)
    ce = F.cross_entropy(logits, y, label_smoothing=0.1)
    kd = distill_loss(logits, teacher(x), "soft", 2.0)
    plain = StepPolicy(dev, "fp32", 0.1)
    assert torch.allclose(training_loss(logits, x, y, plain), ce)
    for w in (0.0, 0.3, 1.0):
        pol = StepPolicy(dev, "fp32", 0.1, distill=Distill(teacher, w, 2.0, "soft"))
        assert torch.allclose(training_loss(logits, x, y, pol), (1 - w) * ce + w * kd, atol=1e-6)
    pol = StepPolicy(dev, "fp32", 0.1, distill=Distill(teacher, 0.5, 2.0, "soft"))
    training_loss(student(x), x, y, pol).backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    assert not teacher.training


@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_a_student_that_never_sees_a_label_learns_from_the_teacher(teacher, tmp_path, kind):
    """weight 1: the labels' term is gone, so all the student learns comes through the teacher's logits."""
    lines: list = []
    cfg = _cfg(tmp_path / "student", "train.epochs=3", f"train.distill.teacher={teacher}", "train.distill.weight=1",
               f"train.distill.kind={kind}", "model.widths=[8,8,16]")
    summary = run(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
    # 10 classes: chance is 0.1 (the teacher: above 0.5; measured: soft 0.395, hard 0.30, the control 0.035)
    assert summary["best_val_acc"] > 0.2
    said = "soft, weight 1, temperature 1" if kind == "soft" else "hard, weight 1"
    assert any(l.startswith(f"distilling from {teacher}") and l.endswith(said) for l in lines), lines
    assert load_checkpoint(tmp_path / "student" / "last.pt")["config"]["train"]["distill"]["teacher"] == str(teacher)


def test_a_teacher_whose_logits_say_nothing_teaches_nothing(teacher, tmp_path):
    """The control for the test above: the same student, taught by the teacher with its classifier zeroed (every
    logit equal), stays near chance, so the signal there came through the teacher's predictions."""
    flat = load_checkpoint(teacher)
    flat["model"] = {k: (torch.zeros_like(v) if k.startswith("fc.") else v) for k, v in flat["model"].items()}
    assert any(k.startswith("fc.") for k in flat["model"])
    save_checkpoint(flat, tmp_path / "flat.pt")  # a whole file: its digest written anew
    cfg = _cfg(tmp_path / "student", "train.epochs=3", f"train.distill.teacher={tmp_path / 'flat.pt'}",
               "train.distill.weight=1", "model.widths=[8,8,16]")
    assert run(cfg, log=lambda *a: None)["best_val_acc"] < 0.15


@pytest.mark.parametrize("change,fragment", [
    ("data.split_seed=1", "data.split_seed: 0, here 1"),
    ("data.val_size=100", "data.val_size: 200, here 100"),
    ("data.image_size=24", "data.image_size: 16, here 24"),
    ("seed=1", "seed: 0, here 1"),  # synthetic images: another seed draws other images
    ("data.synthetic_size=800", "data.synthetic_size: 700, here 800"),
])
def test_a_teacher_that_held_out_other_images_is_refused(teacher, tmp_path, change, fragment):
    cfg = _cfg(tmp_path / "s", f"train.distill.teacher={teacher}", change)
    with pytest.raises(ConfigError, match="other data settings") as e:
        run(cfg, log=lambda *a: None)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "s" / "last.pt").exists()


def test_cli_names_a_missing_teacher_in_one_line(tmp_path, capsys):
    rc = main(["--config", str(ROOT / "configs" / "smoke.yaml"), f"run_dir={tmp_path / 'r'}", *QUIET,
               f"train.distill.teacher={tmp_path / 'nope.pt'}"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1 and "train.distill.teacher" in err and "Traceback" not in err


@pytest.mark.parametrize("override,fragment", [("train.distill.weight=1.5", "train.distill.weight"),
                                               ("train.distill.kind=medium", "train.distill.kind"),
                                               ("train.distill.temperature=0", "train.distill.temperature")])
def test_bad_distill_options_are_one_line_config_errors(override, fragment, tmp_path, capsys):
    rc = main(["--config", str(ROOT / "configs" / "smoke.yaml"), f"run_dir={tmp_path}", override])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and fragment in err and len(err.splitlines()) == 1


def test_resume_with_another_teacher_setting_is_refused(teacher, tmp_path):
    rd = tmp_path / "s"
    run(_cfg(rd, "train.epochs=1", "train.max_steps=2", f"train.distill.teacher={teacher}"), log=lambda *a: None)
    before = (rd / "last.pt").read_bytes()
    cfg = _cfg(rd, "train.epochs=1", "resume=auto", f"train.distill.teacher={teacher}", "train.distill.weight=0.9")
    with pytest.raises(CheckpointError, match="train.distill.weight"):
        run(cfg, log=lambda *a: None)
    assert (rd / "last.pt").read_bytes() == before
    # the same settings resume
    run(_cfg(rd, "train.epochs=1", "resume=auto", f"train.distill.teacher={teacher}"), log=lambda *a: None)
    assert json.loads((rd / "metrics.jsonl").read_text().splitlines()[-1])["epoch"] == 1


def test_throughputs_step_runs_the_teacher_of_a_distilling_config(teacher):
    """``python -m bench.speed flops`` times what a distilling run pays: the teacher's forward pass in every step."""
    throughput = _bench("speed")
    plain = throughput.build(str(ROOT / "configs" / "smoke.yaml"), batch=4, steps=1, overrides=QUIET)
    setup = throughput.build(str(ROOT / "configs" / "smoke.yaml"), batch=4, steps=1,
                             overrides=[*QUIET, f"train.distill.teacher={teacher}"])
    assert plain.distill is None and setup.distill is not None and not setup.distill.teacher.training
    calls = []
    setup.distill.teacher.register_forward_hook(lambda *a: calls.append(1))
    (label, kind, step), = throughput.variants(setup, compile_=False, baseline=False)
    step(*setup.batches[0])
    assert calls == [1]


def test_load_teacher_gives_a_frozen_eval_model_in_the_asked_layout(teacher):
    """One loader for the trainer and the throughput bench: frozen, eval mode, the run's memory format."""
    from visattn.distill import load_teacher

    d = _cfg(Path("unused"), f"train.distill.teacher={teacher}", "train.distill.temperature=2").train.distill
    distill, tcfg, state = load_teacher(d, torch.device("cpu"), channels_last=True)
    assert (distill.weight, distill.temperature, distill.kind) == (d.weight, 2.0, d.kind)
    assert not distill.teacher.training and not any(p.requires_grad for p in distill.teacher.parameters())
    conv = next(m for m in distill.teacher.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and conv.weight.shape[-1] > 1
    assert tcfg.model.name == _cfg(Path("unused")).model.name and state["epoch"] == 3
    with pytest.raises(ConfigError, match="not a checkpoint file"):
        load_teacher(d.model_copy(update={"teacher": str(teacher) + ".missing"}), torch.device("cpu"))


def _bench(name: str):
    import importlib

    return importlib.import_module(f"bench.{name}")
