"""The training engine: precision, optimizer, schedule, one training epoch, evaluation.

Functions here take explicit arguments, never the whole config (that is read once, in ``trainer.py``).
The hot loop keeps its statistics on the device and reads them on the host only every ``check_every``
steps (on a CPU a finished scalar costs nothing to read, so there it checks every step and can skip a
non-finite step before it touches the weights).
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError, TrainingError
from .registry import backbone_modules

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} asked for but no CUDA device is available (use device=auto or cpu)")
    return dev


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls and convolutions in hardware (AMX tiles or AVX512-BF16).

    Without either, oneDNN and MKL emulate bf16 and a bf16 matmul runs tens of times *slower* than fp32
    (measured on a 2-core AVX2 AMD EPYC: about 0.0004 against 0.035 TFLOP/s at one thread)."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' -> bf16 where the device runs it natively (Ampere+ GPUs; CPUs with AMX or AVX512-BF16), fp16 on
    older GPUs, fp32 on other CPUs (where bf16 is emulated and slower than fp32)."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if device.type == "cpu" and cpu_has_native_bf16() else "fp32"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    dtype = AMP_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_scaler(device: torch.device, precision: str) -> Optional[torch.amp.GradScaler]:
    """fp16 needs loss scaling (its range is narrow); bf16 and fp32 do not."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, momentum: float = 0.9,
                    nesterov: bool = True, betas: Sequence[float] = (0.9, 0.999),
                    no_decay_norm_bias: bool = True, norm_bias_lr_scale: float = 1.0) -> torch.optim.Optimizer:
    """SGD (Nesterov by default), AdamW or Muon through timm's ``create_optimizer_v2``.

    Muon (timm's ``Muon``, Jordan et al. 2024) orthogonalises the momentum of every weight matrix and
    convolution filter bank (``momentum``, Nesterov with ``nesterov``); its step is scaled to AdamW's update
    size, so ``lr`` means what it means for AdamW. The classifier (``head``, ``fc``, ``classifier``), 1-d
    parameters and those in ``no_weight_decay()`` (positional embeddings, class token) go to its AdamW
    fallback with ``betas``. Where the CPU emulates bf16 (:func:`cpu_has_native_bf16`), its Newton-Schulz
    iterations run in fp32 instead of timm's bf16 (about 30x faster there).

    With ``no_decay_norm_bias`` (the default) norm weights, biases (all 1-d tensors) and every parameter the
    model lists in ``no_weight_decay()`` (a ViT's ``pos_embed`` and ``cls_token``) get no weight decay.
    ``norm_bias_lr_scale`` puts the biases of the norm layers in a group of their own whose learning rate is
    that many times ``lr`` (airbench trains BatchNorm biases 64x faster); the schedulers honour it. That rule
    is the backbone's: the norms inside attention blocks train at ``lr``.
    """
    from timm.optim import create_optimizer_v2

    kwargs: Dict[str, Any] = {}
    if name == "sgd":
        opt = "sgd" if nesterov and momentum > 0 else "momentum"  # timm: "sgd" is Nesterov, "momentum" is not
        kwargs["momentum"] = momentum
    elif name == "adamw":
        opt = "adamw"
        kwargs["betas"] = tuple(betas)
    elif name == "muon":
        opt = "muon"
        kwargs.update(momentum=momentum, nesterov=nesterov, betas=tuple(betas), fallback_list=MUON_FALLBACK,
                      fallback_no_weight_decay=True)
    else:
        raise ConfigError(f"optim.name: unknown optimizer {name!r}; valid: sgd, adamw, muon")
    params: Any = model
    if norm_bias_lr_scale != 1.0:
        params = _groups_with_norm_bias_scale(model, weight_decay, no_decay_norm_bias, norm_bias_lr_scale)
    optimizer = create_optimizer_v2(params, opt=opt, lr=lr, weight_decay=weight_decay,
                                    filter_bias_and_bn=no_decay_norm_bias, **kwargs)
    if name == "muon" and not _native_bf16_for(model):
        _newton_schulz_in_fp32(optimizer)
    return optimizer


MUON_FALLBACK = ("head.*", "fc.*", "classifier.*")  # the classifier trains with AdamW, as in Muon's recipes


def _native_bf16_for(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is None or p.device.type != "cpu" or cpu_has_native_bf16()


def _newton_schulz_in_fp32(optimizer: torch.optim.Optimizer) -> None:
    """Run this Muon instance's Newton-Schulz iterations in fp32: timm's module-level function defaults to bf16,
    which CPUs without AMX or AVX512-BF16 emulate. The swap lasts only for this optimizer's ``step``."""
    import functools
    import types

    import timm.optim.muon as muon

    step, ns = type(optimizer).step, muon.zeropower_via_newtonschulz

    def step_fp32(self: torch.optim.Optimizer, *args: Any, **kw: Any) -> Any:
        muon.zeropower_via_newtonschulz = functools.partial(ns, dtype=torch.float32)
        try:
            return step(self, *args, **kw)
        finally:
            muon.zeropower_via_newtonschulz = ns

    # a bound method, as torch's LR schedulers expect when they wrap ``step``
    optimizer.step = types.MethodType(step_fp32, optimizer)  # type: ignore[method-assign]


def _groups_with_norm_bias_scale(model: nn.Module, weight_decay: float, no_decay_1d: bool,
                                 scale: float) -> List[Dict[str, Any]]:
    from timm.optim import param_groups_weight_decay

    norm_types = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    # the backbone's norms only: a block's own norms (a gate's BN, a residual block's output BN) keep lr
    norm_biases = {id(m.bias) for m in backbone_modules(model) if isinstance(m, norm_types) and m.bias is not None}
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    if no_decay_1d:
        groups = param_groups_weight_decay(model, weight_decay, no_weight_decay_list=skip)
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    out = []
    for g in groups:
        rest = [p for p in g["params"] if id(p) not in norm_biases]
        fast = [p for p in g["params"] if id(p) in norm_biases]
        out += [dict(g, params=rest)] if rest else []
        out += [dict(g, params=fast, lr_scale=scale)] if fast else []
    return out


class StepScheduler:
    """One interface, stepped once per optimizer step, over torch's OneCycleLR and timm's cosine schedule."""

    def __init__(self, optimizer: torch.optim.Optimizer, name: str, lr: float, total_steps: int, warmup_steps: int,
                 min_lr_ratio: float = 0.0, anneal: str = "linear", start_lr_ratio: float = 0.04):
        self.name = name
        self.num_updates = 0
        self.inner: Any = None
        if name == "onecycle":
            # OneCycleLR divides by each phase's length in steps: keep both phases at least 1 step long
            total = max(total_steps, 4)
            pct = min(max(warmup_steps, 2), total - 2) / total
            # each group peaks at lr times its "lr_scale" (e.g. BN biases at a higher rate), starting from
            # start_lr_ratio of that, ending at min_lr_ratio of it (about 0 when min_lr_ratio is 0)
            max_lr = [lr * g.get("lr_scale", 1.0) for g in optimizer.param_groups]
            self.inner = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=max_lr, total_steps=total, pct_start=pct, anneal_strategy=anneal,
                cycle_momentum=False, div_factor=1.0 / start_lr_ratio,
                final_div_factor=start_lr_ratio / max(min_lr_ratio, 1e-4) if min_lr_ratio else 1e4,
            )
        elif name == "cosine":
            from timm.scheduler import CosineLRScheduler

            self.inner = CosineLRScheduler(
                optimizer, t_initial=max(total_steps - warmup_steps, 1), lr_min=lr * min_lr_ratio,
                warmup_t=warmup_steps, warmup_lr_init=lr * 0.01, warmup_prefix=True, t_in_epochs=False,
            )
        elif name != "constant":
            raise ConfigError(f"sched.name: unknown schedule {name!r}; valid: onecycle, cosine, constant")

    def step(self) -> None:
        self.num_updates += 1
        if self.name == "onecycle":
            if self.inner.last_epoch + 1 < self.inner.total_steps:
                with warnings.catch_warnings():  # an fp16 step skipped by the scaler is not a misordered call
                    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
                    self.inner.step()
        elif self.name == "cosine":
            self.inner.step_update(self.num_updates)

    def state_dict(self) -> Dict[str, Any]:
        return {"num_updates": self.num_updates, "inner": self.inner.state_dict() if self.inner is not None else {}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.num_updates = int(state["num_updates"])
        if self.inner is not None:
            self.inner.load_state_dict(state["inner"])


# the running statistics of an epoch, one float64 tensor on the device (saved in mid-epoch checkpoints)
STATS = ("loss_sum", "correct", "images", "nonfinite", "scaler_skipped", "steps", "finite_images")


def epoch_stats_tensor(carry: Optional[torch.Tensor], position: int, device: torch.device) -> torch.Tensor:
    """The statistics an epoch starts from: zeros, or ``carry`` (a mid-epoch checkpoint's) on ``device``.

    A carry saved before the step count and the finite-image count were kept (5 values) gets them from the
    loader's ``position`` (batches served), taking the non-finite steps' batches as full ones.
    """
    if carry is None:
        return torch.zeros(len(STATS), dtype=torch.float64, device=device)
    carry = carry.to(device).double().flatten()
    if carry.numel() == 5:
        images, nonfinite = float(carry[2]), float(carry[3])
        finite = images * max(position - nonfinite, 0) / position if position else images
        carry = torch.cat([carry, torch.tensor([float(position), finite], dtype=torch.float64, device=device)])
    return carry


@dataclass
class EpochStats:
    """An epoch's totals. ``loss`` and ``acc`` are means over the steps whose loss was finite: NaN when there
    were none. ``steps`` and ``nonfinite_steps`` count the whole epoch (a resumed part included); ``new_steps``
    and ``new_nonfinite`` only the steps this call ran. Under data parallelism the counts are summed over ranks.
    """

    loss: float
    acc: float
    images: int
    seconds: float
    nonfinite_steps: int = 0
    skipped_steps: int = 0  # fp16: optimizer steps the GradScaler skipped (inf/NaN gradients)
    steps: int = 0
    new_steps: int = 0
    new_nonfinite: int = 0

    @property
    def images_per_s(self) -> float:
        return self.images / max(self.seconds, 1e-9)

    @property
    def nothing_learned(self) -> bool:
        """Every step of the epoch, or every step this call ran (a resumed tail), had a non-finite loss."""
        return (0 < self.steps <= self.nonfinite_steps) or (0 < self.new_steps <= self.new_nonfinite)


@dataclass
class StepHooks:
    """Called by :func:`train_one_epoch` between steps (checkpoints, signals, step limits, progress bars)."""

    after_step: Optional[Callable[[int], bool]] = None  # gets the global step; True stops the epoch early
    on_check: Optional[Callable[[int, float, float], None]] = None  # (global step, mean loss, lr) at host reads


class Lookahead:
    """Lookahead-style weight averaging on a cubic schedule (airbench94; Zhang et al. 2019, arXiv 1907.08610).

    Every ``every`` steps the slow copy moves toward the fast weights, ``slow = a * slow + (1 - a) * fast``,
    and the fast weights are reset to it, with ``a = decay ** every * (step / total_steps) ** power``: no
    averaging early, strong averaging at the end. :meth:`finish` puts the slow weights into the model after
    the last step. Float parameters and buffers (BN running statistics) take part; integer buffers do not.
    """

    def __init__(self, model: nn.Module, total_steps: int, every: int = 5, decay: float = 0.95, power: float = 3.0):
        self.total_steps, self.every, self.decay, self.power = max(total_steps, 1), every, decay, power
        self.fast = [t for t in model.state_dict().values() if t.is_floating_point()]  # share the model's storage
        self.slow = [t.detach().clone() for t in self.fast]

    @torch.no_grad()
    def step(self, global_step: int) -> None:
        if global_step % self.every:
            return
        a = self.decay ** self.every * min(global_step / self.total_steps, 1.0) ** self.power
        torch._foreach_lerp_(self.slow, self.fast, 1.0 - a)
        torch._foreach_copy_(self.fast, self.slow)

    @torch.no_grad()
    def finish(self) -> None:
        torch._foreach_copy_(self.fast, self.slow)

    def state_dict(self) -> Dict[str, Any]:
        return {"slow": [t.clone() for t in self.slow]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for t, saved in zip(self.slow, state["slow"]):
            t.copy_(saved)


@dataclass
class Optimization:
    """What takes a training step: the optimizer, its per-step schedule, and the optional extras."""

    optimizer: torch.optim.Optimizer
    scheduler: StepScheduler
    scaler: Optional[torch.amp.GradScaler] = None  # fp16 loss scaling
    ema: Optional[nn.Module] = None  # timm ModelEmaV3, updated after every applied step
    grad_clip: Optional[float] = None
    lookahead: Optional[Lookahead] = None


@dataclass
class Distill:
    """A frozen teacher whose logits on each training batch join the loss (:func:`distill_loss`)."""

    teacher: nn.Module
    weight: float = 0.5
    temperature: float = 1.0
    kind: str = "soft"


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str = "soft",
                 temperature: float = 1.0) -> torch.Tensor:
    """The distillation term: ``soft``, KL(teacher || student) of the softmaxes at ``temperature``, times
    ``temperature**2`` so its gradients keep their size as the temperature changes (Hinton et al. 2015);
    ``hard``, cross-entropy against the teacher's top class (DeiT). Both in fp32, mean over the batch."""
    student, teacher = student.float(), teacher.float()
    if kind == "hard":
        return F.cross_entropy(student, teacher.argmax(1))
    if kind != "soft":
        raise ConfigError(f"train.distill.kind: unknown kind {kind!r}; valid: soft, hard")
    t = temperature
    return F.kl_div(F.log_softmax(student / t, 1), F.log_softmax(teacher / t, 1), reduction="batchmean",
                    log_target=True) * t * t


@dataclass
class StepPolicy:
    """How steps run and are checked: device, precision, loss smoothing, the non-finite policy."""

    device: torch.device
    precision: str = "fp32"
    label_smoothing: float = 0.0
    max_nonfinite_steps: int = 10  # consecutive non-finite losses before TrainingError
    check_every: int = 20  # steps between host reads of the statistics (GPUs; a CPU reads every step)
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # all-reduce under data parallelism
    distill: Optional[Distill] = None  # a teacher's logits in the loss


def host_check_every(policy: StepPolicy) -> int:
    """Steps between the loop's host reads: ``policy.check_every`` on a GPU (a read waits for the queued steps),
    every step on a CPU (reading a finished scalar is free there)."""
    return 1 if policy.device.type == "cpu" else policy.check_every


def training_loss(logits: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, policy: StepPolicy) -> torch.Tensor:
    """Label-smoothed cross-entropy, mixed with the teacher's distillation term when ``policy.distill``."""
    loss = F.cross_entropy(logits.float(), yb, label_smoothing=policy.label_smoothing)
    d = policy.distill
    if d is None or d.weight == 0:
        return loss
    with torch.no_grad(), autocast(policy.device, policy.precision):
        target = d.teacher(xb)
    return (1 - d.weight) * loss + d.weight * distill_loss(logits, target, d.kind, d.temperature)


def _apply_step(model: nn.Module, loss: torch.Tensor, finite: torch.Tensor, opt: Optimization,
                policy: StepPolicy, check_every: int) -> tuple[bool, torch.Tensor]:
    """Backward and optimizer step; returns (step applied, 1 if the GradScaler skipped it else 0)."""
    skipped = torch.zeros((), dtype=torch.float64, device=policy.device)
    scaler = opt.scaler
    if scaler is not None:
        scaler.scale(loss).backward()
        if opt.grad_clip:
            scaler.unscale_(opt.optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        scale_before = scaler._scale.clone() if getattr(scaler, "_scale", None) is not None else None
        scaler.step(opt.optimizer)  # skipped inside when the gradients hold inf/NaN
        scaler.update()
        if scale_before is not None:  # the scale backs off exactly when the step was skipped
            skipped = (scaler._scale < scale_before).double().sum()
        return True, skipped
    reduce = policy.reduce
    if check_every == 1 and not (bool(finite) if reduce is None else bool(reduce((~finite).float()) == 0)):
        # CPU: skip the step before it touches the weights; under data parallelism every rank skips together
        # (a rank-local skip would leave the others waiting in the gradient all-reduce)
        return False, skipped
    loss.backward()
    if opt.grad_clip:
        nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
    opt.optimizer.step()
    return True, skipped


def train_one_epoch(model: nn.Module, loader: Iterable, opt: Optimization, policy: StepPolicy, *,
                    hooks: StepHooks = StepHooks(), global_step: int = 0,
                    carry: Optional[torch.Tensor] = None) -> tuple[EpochStats, int, torch.Tensor]:
    """Train for one pass of ``loader``. Returns (stats, global step, the raw statistics tensor).

    The statistics (:data:`STATS`: loss sum and correct predictions over the finite steps, images, non-finite
    losses, scaler-skipped steps, steps, images of the finite steps) stay on the device and are updated in place
    (the caller may checkpoint them mid-epoch); ``carry`` resumes those of a partly done epoch.
    """
    model.train()
    device = policy.device
    stats = epoch_stats_tensor(None, 0, device) if carry is None else carry
    start = stats.clone()  # this call's own part is ``stats - start``
    consecutive = torch.zeros((), dtype=torch.int64, device=device)  # current run of non-finite losses
    check_every = host_check_every(policy)
    t0 = time.perf_counter()
    for xb, yb in loader:
        with autocast(device, policy.precision):
            logits = model(xb)
        loss = training_loss(logits, xb, yb, policy)
        opt.optimizer.zero_grad(set_to_none=True)
        finite = torch.isfinite(loss.detach())
        step_ok, skipped = _apply_step(model, loss, finite, opt, policy, check_every)
        if step_ok:
            opt.scheduler.step()
            if opt.ema is not None:  # a warming-up EMA's decay follows the step count (from 1), kept in checkpoints
                opt.ema.update(model, step=global_step + 1 if getattr(opt.ema, "use_warmup", False) else None)
        global_step += 1
        if opt.lookahead is not None:
            opt.lookahead.step(global_step)
        n = yb.shape[0]
        with torch.no_grad():
            zero = torch.zeros((), dtype=torch.float64, device=device)
            stats += torch.stack([torch.where(finite, loss.detach().double() * n, zero),
                                  torch.where(finite, (logits.argmax(1) == yb).sum().double(), zero), zero + n,
                                  (~finite).double(), skipped, zero + 1, torch.where(finite, zero + n, zero)])
        consecutive = torch.where(finite, torch.zeros_like(consecutive), consecutive + 1)
        if global_step % check_every == 0:
            _check(int(consecutive), global_step, stats, opt, policy, hooks, check_every)
        if hooks.after_step is not None and hooks.after_step(global_step):
            break
    both = torch.cat([stats, stats - start])
    total = (policy.reduce(both) if policy.reduce is not None else both).tolist()
    seconds = time.perf_counter() - t0  # after the host read: on a GPU it waits for the epoch's queued steps
    loss_sum, correct, images, nonfinite, skipped_steps, steps, good = total[: len(STATS)]
    new = dict(zip(STATS, total[len(STATS) :]))
    return (
        EpochStats(loss=loss_sum / good if good else float("nan"), acc=correct / good if good else float("nan"),
                   images=int(images), seconds=seconds, nonfinite_steps=int(nonfinite),
                   skipped_steps=int(skipped_steps), steps=int(steps), new_steps=int(new["steps"]),
                   new_nonfinite=int(new["nonfinite"])),
        global_step,
        stats,
    )


def _check(run: int, global_step: int, stats: torch.Tensor, opt: Optimization, policy: StepPolicy,
           hooks: StepHooks, check_every: int) -> None:
    """The host read every ``check_every`` steps: stop on too many non-finite losses, report the loss."""
    if run >= policy.max_nonfinite_steps:
        raise TrainingError(
            f"{run} consecutive non-finite losses at step {global_step}; stopping "
            "(lower optim.lr, use precision=bf16/fp32, or set optim.grad_clip)"
        )
    if hooks.on_check is not None and (global_step % max(check_every, 20) == 0):
        s = stats.tolist()
        hooks.on_check(global_step, s[0] / s[6] if s[6] else float("nan"), opt.optimizer.param_groups[0]["lr"])


def tta_views(x: torch.Tensor, tta: str) -> List[torch.Tensor]:
    """Test-time views: the image, its mirror, and (flip_translate) 1-pixel shifts of both."""
    views = [x]
    if tta in ("flip", "flip_translate"):
        views.append(x.flip(3))
    if tta == "flip_translate":
        pad = F.pad(x, (1, 1, 1, 1), mode="reflect")
        H, W = x.shape[-2:]
        for dy, dx in ((0, 0), (2, 2)):
            shifted = pad[..., dy : dy + H, dx : dx + W]
            views += [shifted, shifted.flip(3)]
    return views


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, *, device: torch.device, precision: str, tta: str = "none",
             num_classes: int = 10, reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Dict[str, Any]:
    """Top-1 accuracy, mean loss and per-class accuracy; logits averaged over the TTA views."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    per_class = torch.zeros(2, num_classes, dtype=torch.float64, device=device)  # correct, count
    t0 = time.perf_counter()
    for xb, yb in loader:
        logits = None
        for v in tta_views(xb, tta):
            with autocast(device, precision):
                out = model(v).float()
            logits = out if logits is None else logits + out
        logits = logits / len(tta_views(xb[:1], tta))
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
        hit = (logits.argmax(1) == yb).double()
        per_class[0].index_add_(0, yb, hit)
        per_class[1].index_add_(0, yb, torch.ones_like(hit))
    packed = torch.cat([loss_sum.view(1), per_class.flatten()])
    if reduce is not None:
        packed = reduce(packed)
    loss_sum, per_class = packed[0], packed[1:].view(2, num_classes)
    n = per_class[1].sum().clamp_min(1)
    model.train(was_training)
    return {
        "acc": float(per_class[0].sum() / n),
        "loss": float(loss_sum / n),
        "per_class_acc": (per_class[0] / per_class[1].clamp_min(1)).tolist(),
        "images": int(n),
        "seconds": time.perf_counter() - t0,
    }
