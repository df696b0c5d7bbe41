"""Typed run configuration: a YAML file plus dotted command-line overrides, checked before anything runs.

The schema is a tree of pydantic models (unknown keys rejected, choices as ``Literal``, ranges as ``Field``);
every problem becomes one :class:`ConfigError` line that names the key and what is allowed, e.g.::

    config error: optim.lr: must be > 0 (got -0.1)
    config error: unknown key 'optim.lrr'; valid keys under optim: betas, lr, momentum, name, nesterov, ...

The resolved config is a plain dict of builtins (``cfg.to_dict()``) so it can be written to the run
directory and into checkpoints that load with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import reprlib
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from .errors import ConfigError
from .registry import ATTENTION, MODELS


def _coerced(annotation: Any, value: Any) -> str:
    """Why ``value`` is not of ``annotation``'s type although pydantic's lax mode would coerce it ("" where it is
    fine, or pydantic refuses it anyway): a bool where a number belongs (``optim.lr=true`` would be 1.0), a
    string where a number belongs, anything but a bool where a bool belongs (``log.tensorboard=1``)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Union:  # Optional[X], Union[bool, Literal["auto"]]: fine if fine for one of them
        if value is None and type(None) in args:
            return ""
        whys = [_coerced(a, value) for a in args if a is not type(None)]
        return "" if not all(whys) else whys[0]
    if origin is Literal:
        return "" if any(value == a and type(value) is type(a) for a in args) else "must be one of " + ", ".join(map(repr, args))
    if annotation is bool:
        return "" if isinstance(value, bool) else "must be true or false"
    if annotation in (int, float):
        if isinstance(value, bool):
            return "must be a number, not true or false"
        return "must be a number, not a string" if isinstance(value, str) else ""
    if origin in (tuple, list) and isinstance(value, (list, tuple)) and args:
        each = args[:1] if origin is list or args[-1] is Ellipsis else args
        for i, v in enumerate(value):
            why = _coerced(each[min(i, len(each) - 1)], v)
            if why:
                return f"value {i} {why}"
    return ""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # no NaN/inf anywhere

    @field_validator("*", mode="before")
    @classmethod
    def _no_coercion(cls, v: Any, info: ValidationInfo) -> Any:
        """A value of another type is refused, never converted (:func:`_coerced`)."""
        why = _coerced(cls.model_fields[info.field_name].annotation, v) if info.field_name else ""
        if why:
            raise ValueError(why)
        return v


class AugmentConfig(_Section):
    crop_padding: int = Field(4, ge=0, le=16, description="pad then random-crop back to size (0: off)")
    padding_mode: Literal["reflect", "constant"] = "reflect"
    hflip: bool = True
    # "random": each image flipped with p=0.5 every epoch; "alternate" (airbench): a random half flipped in
    # the first epoch, and every image's orientation switched each later epoch (tensor loader only)
    hflip_mode: Literal["random", "alternate"] = "random"
    cutout: int = Field(0, ge=0, le=32, description="side of a square cutout hole in pixels (0: off)")
    # Extra albumentations transforms, by class name and keyword arguments, e.g.
    # [{name: ColorJitter, brightness: 0.2, p: 0.5}]; they need data.loader=albumentations. The transforms
    # themselves are checked by the data layer before training (this module imports no other part of visattn).
    extra: List[Dict[str, Any]] = Field(default_factory=list)


MAX_SYNTHETIC_BYTES = 8 * 2**30  # synthetic images are made in memory
# the smallest data.std accepted: pixels lie in [0, 1] (CIFAR-10's per-channel std is about 0.25), so a smaller
# value is a typo that scales the inputs by over 1000x (1e-300 makes them inf and every loss NaN)
MIN_STD = 1e-3


class PlacedConfig(_Section):
    """``data.source=placed``: each image of ``source`` on a ``canvas``-px square at a seeded place (docs/maps.md)."""

    source: Literal["auto", "folder", "cifar_python", "synthetic"] = "auto"  # where the images come from
    canvas: int = Field(80, ge=16, le=512)
    background: Literal["mosaic", "noise"] = "mosaic"  # squares of other images of the same split, or noise
    patch: int = Field(4, ge=1, le=64, description="side of the mosaic's squares in pixels")
    tolerance: int = Field(4, ge=0, le=64, description="the pointing game's tolerance in px; positions are balanced for it")
    seed: int = Field(0, ge=0, lt=2**32)
    object: bool = True  # false: the object's box is background too (the background-only check)


class DataConfig(_Section):
    # its only floats, mean and std, have a finite check of their own that names the whole value
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=True)
    source: Literal["auto", "folder", "cifar_python", "torchvision", "synthetic", "placed"] = "auto"
    placed: PlacedConfig = Field(default_factory=PlacedConfig)
    root: str = "data"
    download: bool = False  # torchvision source only: fetch CIFAR-10 into root when absent
    val_size: int = Field(5000, ge=0, description="held-out validation images (stratified) when there is no test split")
    split_seed: int = Field(0, ge=0, lt=2**32)  # seeds the held-out split and the subset, apart from the run's seed
    use_test_split: bool = True  # a test/ folder or the official test batch, when present, is the eval split
    subset: Optional[int] = Field(None, ge=10, description="use only this many training images (stratified)")
    cache_dir: Optional[str] = None  # decoded uint8 arrays; default: <XDG cache>/visattn
    synthetic_size: int = Field(2000, ge=20, le=1_000_000)
    image_size: int = Field(32, ge=8, le=512)
    loader: Literal["tensor", "albumentations"] = "tensor"
    workers: int = Field(0, ge=0, le=64)
    mean: Tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
    std: Tuple[float, float, float] = (0.2470, 0.2435, 0.2616)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    on_bad_image: Literal["error", "skip"] = "error"
    # images of more pixels are refused (or skipped) before they are decoded: a decompression bomb (a small
    # file that decodes to gigabytes) never reaches memory
    max_image_pixels: int = Field(50_000_000, ge=64, le=2**31)

    @field_validator("mean", "std")
    @classmethod
    def _check_finite(cls, v: Tuple[float, float, float], info: ValidationInfo) -> Tuple[float, float, float]:
        if not all(math.isfinite(x) for x in v):
            raise ValueError("every value must be a finite number")
        if info.field_name == "std" and not all(x >= MIN_STD for x in v):
            raise ValueError(f"every value must be >= {MIN_STD:g} (a standard deviation of pixel values in [0, 1]; "
                             "CIFAR-10's is about 0.25)")
        return v

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.augment.hflip_mode == "alternate" and self.loader != "tensor":
            raise ValueError("augment.hflip_mode=alternate needs loader=tensor")
        if self.augment.extra and self.loader != "albumentations":
            raise ValueError("augment.extra needs loader=albumentations (the tensor loader runs only crop, flip and cutout)")
        synthetic = self.source == "synthetic" or (self.source == "placed" and self.placed.source == "synthetic")
        if synthetic and self.synthetic_size * self.image_size**2 * 3 > MAX_SYNTHETIC_BYTES:
            raise ValueError(f"synthetic_size={self.synthetic_size} images of {self.image_size}x{self.image_size} need "
                             f"{self.synthetic_size * self.image_size**2 * 3 / 2**30:.0f} GiB; the limit is "
                             f"{MAX_SYNTHETIC_BYTES // 2**30} GiB")
        return self


def _option_kind(model: str, key: str, default: Any) -> str:
    """What model option ``key`` takes, from its builder's annotation, else its default: ``bool``, ``int``,
    ``float``, ``mapping``, ``list``, or "" (anything; the builder checks it)."""
    written = MODELS.annotations(model).get(key, "").replace(" ", "").replace("typing.", "")
    core = re.sub(r"^Optional\[(.*)\]$", r"\1", written)
    if core in ("bool", "int", "float"):
        return core
    if re.match(r"(Dict|Mapping|MutableMapping|dict)\b", core):
        return "mapping"
    if re.match(r"(Sequence|List|Tuple|list|tuple)\b", core):
        return "list"
    if written or default is None:
        return ""
    return "bool" if isinstance(default, bool) else "float" if isinstance(default, float) else \
        "int" if isinstance(default, int) else ""


def _typed_option(model: str, key: str, value: Any, default: Any) -> Any:
    """``value`` as model option ``key`` takes it (:func:`_option_kind`), or a ValueError naming the key. Numbers
    keep their type (YAML 1.1 reads 1e38, no dot, as a string: converted where the builder wants a number); a
    bool is never a number, a list never a mapping, a string or a mapping never a list."""
    kind, where = _option_kind(model, key, default), f"option {key!r} of model {model!r}"
    if not kind and isinstance(value, bool) and isinstance(default, (int, float)) and not isinstance(default, bool):
        # an option of a wider type (cct's img_size: an int or (H, W)) whose default is a number: a bool is none
        raise ValueError(f"{where} must be a number, not {str(value).lower()} (a bool)")
    if value is None or not kind:
        if kind == "bool" and value is None and default is not None:
            raise ValueError(f"{where} must be true or false, not {value!r}")
        return value
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, not {_SHORT.repr(value)}")
    if kind in ("int", "float"):
        if isinstance(value, str):
            try:
                value = float(value) if kind == "float" else int(value)
            except ValueError:
                raise ValueError(f"{where} must be a number, not {_SHORT.repr(value)}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, not {_SHORT.repr(value)}")
        if kind == "int" and isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"{where} must be an integer, not {value!r}")
            value = int(value)
    if kind == "mapping" and not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping (key: value), not a {type(value).__name__} ({_SHORT.repr(value)})")
    if kind == "list" and not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must be a list, not a {type(value).__name__} ({_SHORT.repr(value)})")
    return value


# model and block options with a range of their own, wherever they appear (``attn_kwargs`` included):
# key -> (low, high, low allowed, high allowed); every other number must only be finite
OPTION_RANGES = {
    **{k: (0.0, 1.0, True, False) for k in ("drop_rate", "attn_drop_rate", "drop_path_rate", "attn_drop", "proj_drop")},
    **{k: (0.0, 64.0, False, True) for k in ("rd_ratio", "mlp_ratio")},
    "bn_momentum": (0.0, 1.0, True, True), "bn_eps": (0.0, 1.0, False, True),
}


def _block_option_kinds() -> Dict[str, str]:
    """Options of the attention blocks that every block taking them has as a number (``rd_ratio``, ``gamma``) or
    as a bool (``bias``), by their defaults: the type ``attn_kwargs`` entries must have."""
    seen: Dict[str, set] = {}
    for name in ATTENTION.names():
        for k, d in ATTENTION.defaults(name).items():
            if d is not None:
                seen.setdefault(k, set()).add("bool" if isinstance(d, bool) else
                                              "number" if isinstance(d, (int, float)) else "other")
    kinds = {k: next(iter(v)) for k, v in seen.items() if len(v) == 1 and v != {"other"}}
    return {**kinds, **{k: "number" for k in OPTION_RANGES}}


def _check_numbers(where: str, value: Any, kinds: Optional[Dict[str, str]] = None) -> None:
    """Every number under ``value`` is finite and within :data:`OPTION_RANGES`, and a nested option a block takes
    as a number or a bool (:func:`_block_option_kinds`) is one (a bool is never a number); raises ValueError
    naming the key."""
    kinds = _block_option_kinds() if kinds is None else kinds
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for k, v in items:
        key = (f"{where}.{k}" if where else str(k)) if isinstance(value, dict) else f"{where}[{k}]"
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"option {key} must be a finite number, got {v}")
        # the blocks' option kinds hold under attn_kwargs; a package builder's model.kwargs are its own (channels: a list)
        block_opts = where.split(".")[0] == "attn_kwargs" or (not where and k in OPTION_RANGES)
        kind = kinds.get(k) if isinstance(value, dict) and block_opts and v is not None else None
        if kind == "number" and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"option {key} must be a number, not {_SHORT.repr(v)}")
        if kind == "bool" and not isinstance(v, bool):
            raise ValueError(f"option {key} must be true or false, not {_SHORT.repr(v)}")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k in OPTION_RANGES:
            lo, hi, lo_in, hi_in = OPTION_RANGES[k]
            if not ((lo <= v if lo_in else lo < v) and (v <= hi if hi_in else v < hi)):
                raise ValueError(f"option {key} must be in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}, "
                                 f"got {v}")
        _check_numbers(key, v, kinds)


class ModelConfig(BaseModel):
    """``name`` picks a registered model, or any timm / torchvision classifier as ``timm/<name>`` /
    ``torchvision/<name>`` (docs/models.md); ``init_from`` (a visattn checkpoint) starts it from trained weights
    (docs/training.md); every other key is passed to its builder as a keyword option."""

    model_config = ConfigDict(extra="allow")
    name: str = "resnet_fast"
    # a checkpoint whose weights the model starts from, with a fresh optimizer and schedule; blocks the
    # checkpoint does not hold (e.g. an attention block added at init: identity) start fresh
    init_from: Optional[str] = Field(None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        MODELS.check(self.name)
        if MODELS.namespace(self.name) is not None:  # timm/<name>, torchvision/<name>: the package's own checks
            MODELS.check_options(self.name, self.options())
            if self.init_from and self.options().get("pretrained_file"):
                raise ValueError("model.init_from and model.pretrained_file both give the starting weights; keep one")
        valid = set(MODELS.options(self.name)) - {"num_classes"}
        defaults = MODELS.defaults(self.name)
        for key, value in self.options().items():
            if key not in valid:
                raise ValueError(f"unknown option {key!r} for model {self.name!r}; valid: "
                                 f"{', '.join(sorted(valid | {'init_from'}))}")
            setattr(self, key, _typed_option(self.name, key, value, defaults.get(key)))
        _check_numbers("", self.options())
        return self

    def options(self) -> Dict[str, Any]:
        return dict(self.model_extra or {})


class OptimConfig(_Section):
    name: Literal["sgd", "adamw", "muon"] = "sgd"  # muon: timm's Muon, AdamW for the classifier and 1-d parameters
    lr: float = Field(0.1, gt=0, le=100)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    betas: Tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(5e-4, ge=0, le=1)
    no_decay_norm_bias: bool = True  # no weight decay on norm weights and biases (1-d parameters)
    norm_bias_lr_scale: float = Field(1.0, gt=0, le=1000)  # norm-layer biases train at lr times this (airbench: 64)
    attn_lr_scale: float = Field(1.0, gt=0, le=1000)  # every attention block's parameters train at lr times this
    grad_clip: Optional[float] = Field(None, gt=0)

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, v: Tuple[float, float]) -> Tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class SchedConfig(_Section):
    name: Literal["onecycle", "cosine", "constant"] = "onecycle"
    warmup_epochs: float = Field(1.0, ge=0, le=10000)  # cosine: linear warmup; onecycle: rise length
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    anneal: Literal["linear", "cos"] = "linear"  # onecycle's decay shape
    start_lr_ratio: float = Field(0.04, gt=0, le=1)  # onecycle starts at lr times this (airbench: 0.2)


# the smallest train.distill.temperature: below 1 the soft term (KL x T**2) shrinks about as T does (at 0.1 it is
# a tenth of its size at 1; T**2 is 0 in fp32 below about 1e-19), so a smaller value trains without the teacher
MIN_TEMPERATURE = 0.1


class DistillConfig(_Section):
    """Knowledge distillation from a trained visattn checkpoint (Hinton et al. 2015; DeiT, Touvron et al. 2021).

    The training loss becomes ``(1 - weight) * CE(labels) + weight * KD``, the KD term the teacher's logits on
    the same augmented batch: ``soft``, the KL divergence of the temperature-``temperature`` softmaxes times
    ``temperature**2``; ``hard`` (DeiT's), cross-entropy against the teacher's top class. The teacher must
    have been trained on this run's training split (same ``data.split_seed``, ``val_size`` and test-split
    use), or it would have seen the images this run is scored on.
    """

    teacher: Optional[str] = None  # path to a visattn checkpoint (a run's last.pt); None: no distillation
    weight: float = Field(0.5, ge=0, le=1)
    temperature: float = Field(1.0, gt=0, le=100)  # a run refuses one below MIN_TEMPERATURE (cross_checks)
    kind: Literal["soft", "hard"] = "soft"


class TrainConfig(_Section):
    epochs: int = Field(10, ge=1, le=10000)
    batch_size: int = Field(256, ge=1, le=65536)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    ema_decay: Optional[float] = Field(None, gt=0, lt=1)  # timm ModelEmaV3 on the weights; evaluated instead
    # the EMA's decay at step t is min(ema_decay, 1 - (1 + t)^(-2/3)) (timm's warmup): it starts as a copy of the
    # weights and reaches ema_decay after 1/(1 - ema_decay)^1.5 steps. Off, a 0.999 EMA of a 1,760-step run
    # keeps 17% of the random initial weights, and the evaluated model scores near chance.
    ema_warmup: bool = True
    ckpt_every_steps: int = Field(0, ge=0)  # also checkpoint every N steps (0: each epoch only)
    max_nonfinite_steps: int = Field(10, ge=1)  # consecutive non-finite losses before the run stops
    check_every: int = Field(20, ge=1)  # steps between host reads of the loss statistics on GPUs
    max_steps: Optional[int] = Field(None, ge=1)  # stop early after this many steps in total (smoke/debug)
    # lookahead weight averaging (airbench): every N steps (0: off) the weights are pulled toward a slow copy
    # with weight lookahead_decay**N * progress**lookahead_power; the slow copy is evaluated and saved at the end
    lookahead_every: int = Field(0, ge=0, le=1000)
    lookahead_decay: float = Field(0.95, gt=0, le=1)
    lookahead_power: float = Field(3.0, ge=0, le=10)
    distill: DistillConfig = Field(default_factory=DistillConfig)


class EvalConfig(_Section):
    batch_size: int = Field(1000, ge=1, le=65536)
    tta: Literal["none", "flip", "flip_translate"] = "flip"
    every: int = Field(1, ge=1)  # evaluate every N epochs (the last epoch always)


class LogConfig(_Section):
    tensorboard: bool = True
    progress: bool = True
    maps_every: int = Field(1, ge=0)  # log attention-map overlays every N epochs (0: never)
    probe_size: int = Field(8, ge=1, le=64)  # validation images in the fixed probe batch
    map_scale: int = Field(2, ge=1, le=16)  # upscale factor of the overlay pictures (2: two probe images a row)
    map_norm: Literal["fixed", "per_image"] = "fixed"  # colour scale: each map kind's fixed scale, or per-image stretch
    # also log the probe's deletion/insertion scores (faithfulness/ scalars, and on each map's card); extra
    # forward passes. "auto": on, unless the first logging epoch shows they cost more than
    # FAITHFULNESS_BUDGET (5%) of that epoch's training time; then off for the rest of the run, said once
    faithfulness: Union[bool, Literal["auto"]] = "auto"
    gradient_maps: bool = True  # also the attention x gradient maps (maps/<layer>/grad, rollout_grad, layers_grad)
    # class-token layers that also get one maps/<layer>/cls_head<i> image per head: each is a PNG encode, and
    # "all" on a 9-layer, 12-head ViT adds 108 of them (~40 s) to every logging epoch on a CPU
    head_maps: Literal["all", "last", "none"] = "last"
    grid_probe: bool = False  # also maps/grid_probe: a 2x2 grid of probe images of 4 classes, one map per class


class Config(_Section):
    name: str = "run"
    run_dir: str = "runs/run"
    seed: int = Field(0, ge=0, lt=2**32)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    channels_last: bool = True
    cpu_heap: Literal["keep", "system"] = "keep"  # on a CPU: glibc keeps freed memory for the next step (cpu_heap.py)
    compile: bool = False
    deterministic: bool = False
    sync_bn: bool = False  # SyncBatchNorm under torchrun
    resume: Optional[str] = None  # None | "auto" | path to a checkpoint
    resume_allow_changes: bool = False  # resume even when model/data settings differ from the checkpoint's
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    sched: SchedConfig = Field(default_factory=SchedConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError("must be one of auto, cpu, cuda, cuda:N")

    @model_validator(mode="after")
    def _home_folder(self) -> "Config":
        """``~`` in the paths of run folders and checkpoints is the home folder, as in ``data.root``."""
        for section, key in ((self, "run_dir"), (self, "resume"), (self.model, "init_from"), (self.train.distill, "teacher")):
            path = getattr(section, key)
            if isinstance(path, str) and path.startswith("~"):
                object.__setattr__(section, key, os.path.expanduser(path))
        return self

    def to_dict(self) -> Dict[str, Any]:
        return self.model_dump(mode="json")


# ----------------------------------------------------------------------------------------------- loading


def _fmt_loc(loc: Sequence[Union[str, int]]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).removeprefix(".")


def _section_at(loc: Sequence[Union[str, int]]) -> Optional[type]:
    """The pydantic model class that holds the key at ``loc`` (for listing valid keys)."""
    cls: Any = Config
    for part in loc[:-1]:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or isinstance(part, int):
            return None
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        cls = field.annotation
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = [p for p in e["loc"] if p not in ("function-after", "function-before")]
    key = _fmt_loc(loc)
    typ = e["type"]
    if typ == "extra_forbidden":
        section = _section_at(loc)
        valid = sorted(section.model_fields) if section else []
        where = _fmt_loc(loc[:-1]) or "the top level"
        hint = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        tail = f" (did you mean {hint[0]!r}?)" if hint else ""
        return f"unknown key {key!r}{tail}; valid keys under {where}: {', '.join(valid)}"
    msg = e["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if typ == "literal_error":
        msg = f"must be one of {e['ctx']['expected']}"
    if key and msg.startswith(f"{key}."):  # a message naming its own key in full (model.pretrained_file: ...)
        key = ""
    got = e.get("input")
    got_s = "" if isinstance(got, dict) else f" (got {_SHORT.repr(got)})"
    return f"{key}: {msg}{got_s}" if key else f"{msg}{got_s}"


# YAML is read with libyaml's safe loader where it is installed (C speed), within limits that keep a hostile
# file from hanging the loader or flooding the terminal: its size, its nesting and the number of values it
# expands to (an "alias bomb" repeats anchors to billions of values from a few hundred bytes)
MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_VALUES = 100_000
_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 80, 80, 8, 8, 3


class _DuplicateKey(Exception):
    pass


class _StrictLoader(_BaseLoader):
    """The safe loader, refusing a key given twice in one mapping (a section given twice included)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Dict[Any, Any]:
        seen: Dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"key {_SHORT.repr(key)} is given twice (lines {seen[key]} and {line})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) reads 1e-4 as a string: it wants a dot (1.0e-4). Read floats as YAML 1.2 does, so that
# `model.layer_scale=1e-4` is a number in a config file and on the command line alike.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _check_yaml_shape(text: str, what: str) -> None:
    """Walk the parser's events (no objects built): refuse deep nesting, recursive aliases and expansion past
    :data:`MAX_YAML_VALUES` values, before the loader builds anything."""
    sizes: List[List[Any]] = [[0, None]]  # per open collection: [values so far, its anchor]
    done: Dict[str, int] = {}  # anchor -> the number of values it stands for
    for ev in yaml.parse(text, Loader=_BaseLoader):
        if isinstance(ev, yaml.CollectionStartEvent):
            if len(sizes) > MAX_YAML_DEPTH:
                raise ConfigError(f"{what}: nested more than {MAX_YAML_DEPTH} levels deep (line {ev.start_mark.line + 1})")
            done.pop(ev.anchor, None)
            sizes.append([0, ev.anchor])
            continue
        if isinstance(ev, yaml.CollectionEndEvent):
            n, anchor = sizes.pop()
            size = n + 1
        elif isinstance(ev, yaml.AliasEvent):
            if ev.anchor not in done:
                raise ConfigError(f"{what}: alias *{ev.anchor} at line {ev.start_mark.line + 1} refers to a value that "
                                  "contains it (a recursive alias)")
            size, anchor = done[ev.anchor], None
        elif isinstance(ev, yaml.ScalarEvent):
            size, anchor = 1, ev.anchor
        else:
            continue
        if anchor is not None:
            done[anchor] = size
        sizes[-1][0] += size
        if sizes[-1][0] > MAX_YAML_VALUES:
            raise ConfigError(f"{what}: expands to more than {MAX_YAML_VALUES:,} values (repeated YAML aliases?)")


def safe_yaml(text: str, what: str) -> Any:
    """``text`` parsed as YAML within the limits above; raises :class:`ConfigError` naming ``what``."""
    try:
        _check_yaml_shape(text, what)
        return yaml.load(text, Loader=_StrictLoader)
    except ConfigError:
        raise
    except _DuplicateKey as e:
        raise ConfigError(f"{what}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        if "nesting depth" in str(e):  # the parser's own depth limit (PyYAML >= 6.0.3): the walk's message
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError(f"{what}: nested more than {MAX_YAML_DEPTH} levels deep{where}") from None
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{what} is not valid YAML{where}") from None
    except RecursionError:
        raise ConfigError(f"{what}: nested too deeply") from None
    except (ValueError, OverflowError) as e:  # e.g. a 100,000-digit number, a date like 2001-13-45
        why = str(e).strip().splitlines()[0][:100] if str(e).strip() else e.__class__.__name__
        raise ConfigError(f"{what} holds a value that cannot be read ({why})") from None


def parse_override(text: str) -> Tuple[List[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value); the value is parsed as YAML (numbers, bools, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. optim.lr=0.1)")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"override {key}: the value is {len(raw):,} characters long; the limit is {MAX_CONFIG_BYTES:,}")
    value = safe_yaml(raw, f"override {key}: value {_SHORT.repr(raw)}") if raw.strip() else ""
    return key.split("."), value


def _set_dotted(tree: Dict[str, Any], path: List[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


def _read_text(p: Path) -> str:
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a folder, not a file")
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} not found")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} is not a regular file")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {str(p)!r} is {p.stat().st_size:,} bytes; the limit is {MAX_CONFIG_BYTES:,}")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(p)!r} is not a text file") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read ({e.strerror or e.__class__.__name__})") from None


MAX_BASE_CHAIN = 16  # configs a file may inherit through (``base:`` of a ``base:`` ...)


def _deep_merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    """``over`` on top of ``base``: mappings merge key by key, anything else (a list included) is replaced."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _deep_merge(out[key], value) if both else value
    return out


def read_yaml(path: Union[str, os.PathLike], _chain: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    """The mapping a config file holds; a top-level ``base: FILE`` (relative to this file) is read first, and
    this file's keys are merged on top of it (:func:`_deep_merge`), so the result never holds ``base``. A file
    that names another ``model.name`` than its base keeps only the base's model options the new model takes
    (:func:`_switch_model`)."""
    p = Path(path)
    data = safe_yaml(_read_text(p), f"config file {str(p)!r}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, not a {type(data).__name__}")
    if "base" not in data:
        return data
    base, chain = data.pop("base"), (*_chain, p.resolve())
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"config file {str(p)!r}: base must be the path of a config file, not {_SHORT.repr(base)}")
    b = p.parent / os.path.expanduser(base)  # "~/x.yaml" is the home folder's, as in data.root
    if b.resolve() in chain:
        names = " -> ".join(f.name for f in (*chain, b.resolve()))
        raise ConfigError(f"config file {str(p)!r}: base {base!r} makes a cycle ({names})")
    if len(chain) > MAX_BASE_CHAIN:
        raise ConfigError(f"config file {str(p)!r}: more than {MAX_BASE_CHAIN} bases in a chain")
    if not b.exists():
        raise ConfigError(f"config file {str(p)!r}: base {base!r} not found (looked for {str(b)!r})")
    inherited = read_yaml(b, chain)
    if isinstance(data.get("model"), dict) and "name" in data["model"]:  # another model: as a model.name override
        _switch_model(inherited, data["model"]["name"])
    return _deep_merge(inherited, data)


def build_config(tree: Dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


# what a model.name switch between visattn's own models and a timm / torchvision one keeps of the file's model section
SWITCH_KEEPS = {"name", "init_from", "attention", "attn_kwargs", "attn_at"}


def _switch_model(tree: Dict[str, Any], name: Any) -> None:
    """An override ``model.name=OTHER`` switches the file's model: the file's builder options that ``OTHER``
    does not take are left out (``widths`` of a visattn ResNet for ``timm/resnet18``); the ones it takes stay
    (``attention``, ``attn_kwargs``), as do ``init_from`` and the overrides that come after. Between visattn's
    models and a package's only the block options (:data:`SWITCH_KEEPS`) stay."""
    section = tree.get("model")
    if not isinstance(section, dict) or not isinstance(name, str) or section.get("name", "resnet_fast") == name:
        return
    try:
        takes = set(MODELS.options(MODELS.check(name))) | {"name", "init_from"}
        old = section.get("name", "resnet_fast")
        across = isinstance(old, str) and (MODELS.namespace(old) is None) != (MODELS.namespace(name) is None)
    except ValueError:  # an unknown name: the schema's check says so
        return
    if across:  # between visattn's models and a package's a shared name is each one's own design (resnet_fast's
        takes &= SWITCH_KEEPS  # airbench bn_momentum 0.4 is not timm's BN): only the block options carry over
    tree["model"] = {k: v for k, v in section.items() if k in takes}


def load_config(path: Optional[Union[str, os.PathLike]] = None, overrides: Sequence[str] = ()) -> Config:
    """Read ``path`` (YAML), apply ``key=value`` overrides, validate; raises :class:`ConfigError`."""
    tree = read_yaml(path) if path is not None else {}
    for text in overrides:
        keys, value = parse_override(text)
        if keys == ["model", "name"]:
            _switch_model(tree, value)
        _set_dotted(tree, keys, value)
    return build_config(tree)


def with_defaults(stored: Dict[str, Any]) -> Dict[str, Any]:
    """A config saved by an earlier visattn (a checkpoint's, a run folder's ``config.yaml``) with the keys added
    since filled in by today's defaults, so that comparing it with a config of today finds only real changes."""
    def fill(defaults: Any, saved: Any) -> Any:
        if not (isinstance(defaults, dict) and isinstance(saved, dict)):
            return saved
        return {**defaults, **{k: fill(defaults.get(k), v) for k, v in saved.items()}}

    return fill(Config().to_dict(), stored)
