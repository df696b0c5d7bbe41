"""What takes a training step's update: the optimizer, its per-step schedule, lookahead and the fp16 loss scaler.

:func:`build_optimizer` goes through timm's ``create_optimizer_v2`` (SGD, AdamW, Muon; Jordan et al. 2024,
"Muon: An optimizer for hidden layers in neural networks"), :class:`StepScheduler` steps torch's ``OneCycleLR``
(Smith & Topin 2017, "Super-Convergence", arXiv 1708.07120) or timm's cosine schedule (Loshchilov & Hutter 2016,
"SGDR", arXiv 1608.03983) once per optimizer step, :class:`Lookahead` averages the weights on airbench94's cubic
schedule (Zhang et al. 2019, "Lookahead Optimizer: k steps forward, 1 step back", arXiv 1907.08610), and
:func:`make_scaler` gives fp16 its ``GradScaler`` (Micikevicius et al. 2017, "Mixed Precision Training", arXiv
1710.03740). :class:`Optimization` holds them for the loop. The pieces take plain arguments; the run's config is
read by :func:`optimization_from` and :func:`schedule_from` alone.
"""
from __future__ import annotations

import functools
import types
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from .config import Config
from .errors import ConfigError
from .evaluate import cpu_has_native_bf16
from .registry import backbone_modules, is_attention_block

MUON_FALLBACK = ("head.*", "fc.*", "classifier.*")  # the classifier trains with AdamW, as in Muon's recipes


# the normalisation layers whose biases the backbone's norm-bias group takes (torch's public classes: every
# batch and instance norm a built model holds, then GroupNorm and LayerNorm)
NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
              nn.InstanceNorm3d, nn.GroupNorm, nn.LayerNorm)


@dataclass
class Optimization:
    """What takes a training step: the optimizer, its per-step schedule, and the optional extras."""

    optimizer: torch.optim.Optimizer
    scheduler: StepScheduler
    scaler: Optional[torch.amp.GradScaler] = None  # fp16 loss scaling
    ema: Optional[nn.Module] = None  # timm ModelEmaV3, updated after every applied step
    grad_clip: Optional[float] = None
    lookahead: Optional[Lookahead] = None


def make_scaler(device: torch.device, precision: str) -> Optional[torch.amp.GradScaler]:
    """fp16 needs loss scaling (its range is narrow); bf16 and fp32 do not."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, momentum: float = 0.9,
                    nesterov: bool = True, betas: Sequence[float] = (0.9, 0.999),
                    no_decay_norm_bias: bool = True, norm_bias_lr_scale: float = 1.0,
                    native_bf16: Optional[bool] = None, attn_lr_scale: float = 1.0) -> torch.optim.Optimizer:
    """SGD (Nesterov by default), AdamW or Muon through timm's ``create_optimizer_v2``.

    Muon (timm's ``Muon``, Jordan et al. 2024) orthogonalises the momentum of every weight matrix and
    convolution filter bank (``momentum``, Nesterov with ``nesterov``); its step is scaled to AdamW's update
    size, so ``lr`` means what it means for AdamW. The classifier (``head``, ``fc``, ``classifier``), 1-d
    parameters and those in ``no_weight_decay()`` (positional embeddings, class token) go to its AdamW
    fallback with ``betas``. Where the CPU emulates bf16 (:func:`cpu_has_native_bf16`), its Newton-Schulz
    iterations run in fp32 instead of timm's bf16 (about 30x faster there); ``native_bf16`` says whether bf16 is
    native where the model lies (``None``: asked of the model's device).

    With ``no_decay_norm_bias`` (the default) norm weights, biases (all 1-d tensors) and every parameter the
    model lists in ``no_weight_decay()`` (a ViT's ``pos_embed`` and ``cls_token``) get no weight decay.
    ``norm_bias_lr_scale`` puts the biases of the norm layers in a group of their own whose learning rate is
    that many times ``lr`` (airbench trains BatchNorm biases 64x faster); the schedulers honour it. That rule
    is the backbone's: the norms inside attention blocks train at ``lr``. ``attn_lr_scale`` does the same for
    every parameter of the attention blocks (:func:`~visattn.registry.is_attention_block`, their own norms
    included): a block inserted into a network trains at that many times the network's rate. At 1 (the default)
    the groups are timm's own, so a checkpoint saved without these options resumes unchanged.
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
    if norm_bias_lr_scale != 1.0 or attn_lr_scale != 1.0:  # groups made here: they carry Muon's fallback marks
        params = _scaled_groups(model, weight_decay, no_decay_norm_bias, norm_bias_lr_scale, attn_lr_scale,
                                MUON_FALLBACK if name == "muon" else ())
    optimizer = create_optimizer_v2(params, opt=opt, lr=lr, weight_decay=weight_decay,
                                    filter_bias_and_bn=no_decay_norm_bias, **kwargs)
    if name == "muon" and not (_native_bf16_for(model) if native_bf16 is None else native_bf16):
        _newton_schulz_in_fp32(optimizer)
    return optimizer


def _native_bf16_for(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is None or p.device.type != "cpu" or cpu_has_native_bf16()


def _newton_schulz_in_fp32(optimizer: torch.optim.Optimizer) -> None:
    """Run this Muon instance's Newton-Schulz iterations in fp32: timm's module-level function defaults to bf16,
    which CPUs without AMX or AVX512-BF16 emulate. The swap lasts only for this optimizer's ``step``."""
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


def _scaled_groups(model: nn.Module, weight_decay: float, no_decay_1d: bool, norm_bias_scale: float = 1.0,
                   attn_scale: float = 1.0, fallback: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """timm's weight-decay groups (as ``create_optimizer_v2`` makes them from a model), each split, in this order,
    into the rest, the backbone's norm biases (``lr_scale=norm_bias_scale``) and the attention blocks' parameters
    (``lr_scale=attn_scale``). A part splits off only where its scale is not 1 and empty parts are left out, so
    the groups are those a checkpoint saved before ``attn_scale`` existed was built with. A
    block's own norms are the block's (``attn_scale``), not the backbone's. ``fallback``: Muon's AdamW patterns
    (:data:`MUON_FALLBACK`); their groups are marked ``use_fallback``, as timm marks them, since Muon cannot read
    names from param groups."""
    from timm.optim import param_groups_weight_decay

    norm_biases = {id(m.bias) for m in backbone_modules(model) if isinstance(m, NORM_TYPES) and m.bias is not None
                   } if norm_bias_scale != 1.0 else set()
    in_blocks = {id(p) for m in model.modules() if is_attention_block(m) for p in m.parameters()
                 } if attn_scale != 1.0 else set()
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    groups = param_groups_weight_decay(model, weight_decay, weight_decay_exclude_1d=no_decay_1d,
                                       no_weight_decay_list=skip, fallback_list=fallback,
                                       fallback_no_weight_decay=bool(fallback))
    out = []
    for g in groups:
        parts = ([p for p in g["params"] if id(p) not in norm_biases and id(p) not in in_blocks], None), \
                ([p for p in g["params"] if id(p) in norm_biases], norm_bias_scale), \
                ([p for p in g["params"] if id(p) in in_blocks], attn_scale)
        out += [dict(g, params=ps, **({} if scale is None else {"lr_scale": scale})) for ps, scale in parts if ps]
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
        elif name == "constant":
            for g in optimizer.param_groups:  # as the other two: each group at lr times its "lr_scale"
                g["lr"] = lr * g.get("lr_scale", 1.0)
        else:
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
        for slow, fast in zip(self.slow, self.fast):  # torch's per-tensor ops (its list ops are private API)
            slow.lerp_(fast, 1.0 - a)
        self.finish()

    @torch.no_grad()
    def finish(self) -> None:
        for slow, fast in zip(self.slow, self.fast):
            fast.copy_(slow)

    def state_dict(self) -> Dict[str, Any]:
        return {"slow": [t.clone() for t in self.slow]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for t, saved in zip(self.slow, state["slow"]):
            t.copy_(saved)


# ----------------------------------------------------------------------------- from the run's config


def optimization_from(cfg: Config, model: nn.Module, steps_per_epoch: int, device: torch.device,
                      precision: str) -> Optimization:
    """The run's :class:`Optimization` as ``cfg`` says: optimizer, per-step schedule, lookahead, EMA, scaler."""
    o = cfg.optim
    optimizer = build_optimizer(model, o.name, o.lr, o.weight_decay, o.momentum, o.nesterov, o.betas,
                                o.no_decay_norm_bias, o.norm_bias_lr_scale, attn_lr_scale=o.attn_lr_scale)
    total = steps_per_epoch * cfg.train.epochs
    scheduler = schedule_from(cfg, optimizer, steps_per_epoch)
    t = cfg.train
    if t.lookahead_every > total:  # its slow copy, put into the model at the end, would be the initial weights
        raise ConfigError(f"train.lookahead_every={t.lookahead_every} is longer than the run's {total} steps "
                          f"({cfg.train.epochs} epochs of {steps_per_epoch} steps): the averaged weights that replace the "
                          "model's at the end would be its initial ones; give at most the run's steps, or 0 (off)")
    lookahead = Lookahead(model, total, t.lookahead_every, t.lookahead_decay, t.lookahead_power) \
        if t.lookahead_every else None
    ema = None
    if cfg.train.ema_decay:
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(model, decay=cfg.train.ema_decay, use_warmup=cfg.train.ema_warmup)
    return Optimization(optimizer, scheduler, make_scaler(device, precision), ema, o.grad_clip, lookahead)

def schedule_from(cfg: Config, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> StepScheduler:
    """``cfg.sched`` over ``cfg.train.epochs`` epochs of ``steps_per_epoch`` steps."""
    s = cfg.sched
    return StepScheduler(optimizer, s.name, cfg.optim.lr, steps_per_epoch * cfg.train.epochs,
                         int(round(s.warmup_epochs * steps_per_epoch)), s.min_lr_ratio, s.anneal, s.start_lr_ratio)
