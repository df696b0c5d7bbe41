"""Any timm or torchvision classifier by name, ``timm/<name>`` or ``torchvision/<name>``, through visattn's one
model path: :func:`~visattn.registry.create_model` builds it like visattn's own models, so the trainer, resume,
``model.init_from``, EMA, the maps, ``evaluate`` and ``visualize`` take it unchanged.

:func:`build_foreign` builds the package's model with ``num_classes`` from the data and the builder options in
``kwargs``, optionally adapts its stem to 32-px inputs (``cifar_stem``, :data:`CIFAR_STEMS`), loads local weights
(``pretrained_file``: ``.safetensors``, a ``.pth``/``.bin`` state dict, or a timm checkpoint; a classifier of
another class count is replaced and reported, every other key must land, of a floating-point type where the
model's is) and inserts an attention block with
:func:`~visattn.attention.insert_attention` (``attention``, ``attn_kwargs``, placement ``attn_at``). Nothing is
downloaded. Every key of ``kwargs`` is checked against the type the builder's class gives it (a bool is never a
number, a string never a bool) and every rate-like one (dropout, drop path, stochastic depth) is a probability
in [0, 1) (:func:`check_kwargs`). Every refusal is a one-line ``ValueError`` naming the option, which the
commands report as a config error.
"""
from __future__ import annotations

import difflib
import functools
import math
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..attention import insert_attention
from ..attention.functional import BATCH_NORMS
from ..own_options import INSERT_OPTIONS, check_own
from ..registry import MODELS
from .builder_options import check_kwargs, package_model

PACKAGES = ("timm", "torchvision")
# builder options visattn sets itself, or that would download: refused in model.kwargs with the reason
RESERVED = {
    "num_classes": "the class count comes from the data",
    "pretrained": "visattn downloads nothing at run time",
    "weights": "visattn downloads nothing at run time",
    "pretrained_cfg": "visattn downloads nothing at run time",
    "pretrained_cfg_overlay": "visattn downloads nothing at run time",
    "checkpoint_path": "local weights go in model.pretrained_file",
    "features_only": "a classifier is trained here",
    "device": "the run places the model", "dtype": "the run sets the precision",
}
DOWNLOAD_HINT = ("download the weights once (e.g. timm.create_model(NAME, pretrained=True), then "
                 "torch.save(model.state_dict(), FILE)) and pass the file as model.pretrained_file=FILE")
# model.head_init: "zero" starts the classifier's weight and bias at zero, every logit 0 and the loss ln(classes) at
# step 0 (as ViT's "jax" init and big_vision do). Unset, the package's own init: timm's EfficientNet and MobileNetV3
# families draw it from U(+-1/sqrt(num_classes)), made for 1000 classes; at 10 it is 10x wider (std 0.18), and
# TinyNet-E starts at a loss of 4.5 against chance's 2.3 (docs/models.md)
MAX_WEIGHTS_BYTES = 4 * 2**30  # a larger "weights file" is not a CIFAR-sized classifier's


# ---- names ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _names(package: str) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(classifier names, every model name) the installed package can build."""
    if package == "timm":
        import timm

        names = tuple(timm.list_models())
        return names, names
    import torchvision.models as tvm

    return tuple(tvm.list_models(module=tvm)), tuple(tvm.list_models())


def resolve(package: str, arch: str) -> str:
    """``arch`` if ``package`` builds a classifier of that name, else a ValueError with the nearest names."""
    classifiers, every = _names(package)
    base = arch.partition(".")[0] if package == "timm" else arch  # timm/resnet18.a1_in1k: a pretrained tag
    if base in classifiers:
        return _check_tag(arch) if package == "timm" and "." in arch else arch
    if base in every:
        raise ValueError(f"{package}/{arch} is not a classifier (a detection, segmentation or video model); "
                         f"classifiers are e.g. {', '.join(difflib.get_close_matches(base, classifiers, n=3, cutoff=0))}")
    near = difflib.get_close_matches(base, classifiers, n=4, cutoff=0.5)
    hint = f"nearest: {', '.join(near)}" if near else f"{len(classifiers):,} names, e.g. {', '.join(classifiers[:3])}"
    raise ValueError(f"unknown {package} model {arch!r} ({hint}; the installed {package} lists them)")


def _check_tag(arch: str) -> str:
    """``arch`` (``NAME.TAG``) where timm knows the pretrained tag ``TAG`` for ``NAME``, else a ValueError about the
    model name (the tag only picks the pretrained config: nothing is downloaded)."""
    import timm

    base, _, tag = arch.partition(".")
    tags = [n.partition(".")[2] for n in timm.list_pretrained(f"{base}.*") if n.partition(".")[0] == base]
    if tag in tags:
        return arch
    known = f"its tags are {', '.join(tags[:4])}{', ...' if len(tags) > 4 else ''}" if tags else "it has no tags"
    near = difflib.get_close_matches(tag, tags, n=1)
    raise ValueError(f"unknown timm model {arch!r}: {base} has no pretrained tag {tag!r} "
                     f"({f'did you mean {near[0]!r}? ' if near else ''}{known}; or give {base} alone)")


# ---- options ---------------------------------------------------------------------------------------------


def check_options(package: str, arch: str, options: Dict[str, Any]) -> None:
    """Types and combinations of the options, without building anything (a config's check)."""
    if "pretrained" in options or "pretrained" in (options.get("kwargs") or {}):
        raise ValueError(f"model.pretrained: {DOWNLOAD_HINT}")
    valid = set(MODELS.options(f"{package}/{arch}")) - {"num_classes"}
    bad = sorted(k for k in options if k not in valid)
    if bad:
        near = difflib.get_close_matches(bad[0], valid, n=1)
        raise ValueError(f"unknown option {bad[0]!r} for model {package}/{arch}"
                         f"{f' (did you mean {near[0]!r}?)' if near else ''}; valid: {', '.join(sorted(valid))}")
    for key, value in options.items():  # visattn's own options: only their documented values (own_options)
        check_own(f"option {key!r} of model {package}/{arch}", key, value)
    for key, value in (options.get("attn_kwargs") or {}).items():  # insert_attention's, given with the block's
        if key in INSERT_OPTIONS:
            check_own(f"option 'attn_kwargs.{key}' of model {package}/{arch}", key, value)
    for key in options.get("kwargs") or {}:
        if key in RESERVED:
            hint = DOWNLOAD_HINT if RESERVED[key].startswith("visattn downloads") else ""
            raise ValueError(f"model.kwargs.{key}: {RESERVED[key]}{'; ' + hint if hint else ''}")
    if isinstance(options.get("kwargs"), dict):
        check_kwargs(package, arch, options["kwargs"])



# ---- the CIFAR stem --------------------------------------------------------------------------------------


def _stem_conv(conv: nn.Conv2d) -> nn.Conv2d:
    """A 3x3 stride-1 convolution in ``conv``'s place: the same module (weights kept) where it is 3x3 already."""
    if conv.kernel_size == (3, 3):
        conv.stride, conv.padding = (1, 1), (1, 1)
        return conv
    new = nn.Conv2d(conv.in_channels, conv.out_channels, 3, 1, 1, bias=conv.bias is not None)
    return new.to(device=conv.weight.device, dtype=conv.weight.dtype)


def _first_conv(seq: nn.Module) -> Tuple[nn.Module, str]:
    """The parent and attribute name of the first ``Conv2d`` inside ``seq``."""
    for name, m in seq.named_modules():
        if isinstance(m, nn.Conv2d):
            parent_name, _, attr = name.rpartition(".")
            return seq.get_submodule(parent_name) if parent_name else seq, attr
    raise ValueError(f"no convolution in the stem {type(seq).__name__}")


def _cifar_stem_of(model: nn.Module) -> Optional[Tuple[nn.Module, Optional[str]]]:
    """(the module holding the stem's first conv, the name of a stem pooling to drop) by family, or None."""
    import timm.models as tm
    import torchvision.models as tvm

    if isinstance(model, (tm.ResNet, tvm.ResNet)):  # 7x7/2 conv (or timm's deep 3x3 stem), then a 3x3/2 max-pool
        return model.conv1, "maxpool"
    if isinstance(model, (tm.RegNet, tvm.RegNet, tm.ConvNeXt)):  # 3x3/2 conv-BN; ConvNeXt: a 4x4/4 patchify conv
        return model.stem, None
    if isinstance(model, (tm.EfficientNet, tm.MobileNetV3)):  # conv_stem 3x3/2
        return model, "conv_stem"
    if isinstance(model, (tvm.ConvNeXt, tvm.EfficientNet, tvm.MobileNetV3)):  # features[0]: conv(-norm-act) /2 or /4
        return model.features[0], None
    return None


CIFAR_STEMS = {
    "ResNet (timm, torchvision)": "conv1 -> 3x3 stride 1 (timm's deep stems: their first conv), max-pool removed",
    "RegNet (timm, torchvision)": "the stem's 3x3 stride-2 conv -> stride 1 (weights kept)",
    "ConvNeXt (timm, torchvision)": "the 4x4 stride-4 patchify conv -> 3x3 stride 1",
    "EfficientNet, MobileNetV3 (timm, torchvision)": "the 3x3 stride-2 stem conv -> stride 1 (weights kept)",
}


def apply_cifar_stem(model: nn.Module, name: str) -> None:
    """A 3x3 stride-1 stem without pooling, for 32-px inputs (:data:`CIFAR_STEMS`); a ValueError elsewhere."""
    found = _cifar_stem_of(model)
    if found is None:
        vit = "; a ViT takes img_size and patch_size through model.kwargs" if hasattr(model, "patch_embed") else ""
        raise ValueError(f"model.cifar_stem: no CIFAR stem for {name} ({type(model).__name__}); it is defined for "
                         f"ResNet, RegNet, ConvNeXt, EfficientNet and MobileNetV3{vit}")
    holder, extra = found
    if extra == "conv_stem":
        model.conv_stem = _stem_conv(model.conv_stem)
        return
    parent, attr = (holder, None) if isinstance(holder, nn.Conv2d) else _first_conv(holder)
    if attr is None:  # the holder is the conv itself (a ResNet's conv1)
        model.conv1 = _stem_conv(holder)
    else:
        setattr(parent, attr, _stem_conv(getattr(parent, attr)))
    if extra == "maxpool":
        model.maxpool = nn.Identity()


# ---- weights from a local file ---------------------------------------------------------------------------


WEIGHT_ENTRIES = ("state_dict_ema", "state_dict", "model")  # a timm checkpoint's weights, in the order taken


def read_weights(path: Union[str, os.PathLike]) -> Dict[str, torch.Tensor]:
    """The state dict in a ``.safetensors`` file, a ``.pth``/``.bin`` state dict or a timm checkpoint (its
    ``state_dict_ema``, ``state_dict`` or ``model`` entry, in that order; a ``module.`` prefix is dropped). Loaded
    without running pickled code; every failure is a one-line ValueError naming the file."""
    return read_weights_entry(path)[0]


def _damaged(what: str, e: BaseException) -> ValueError:
    first = str(e).strip().splitlines()[0][:120] if str(e).strip() else e.__class__.__name__
    return ValueError(f"{what} is damaged or not a weights file ({first})")


def read_weights_entry(path: Union[str, os.PathLike]) -> Tuple[Dict[str, torch.Tensor], Optional[str], List[str]]:
    """:func:`read_weights`'s state dict, the checkpoint entry it came from (None for a plain state dict) and
    the other weight entries the file holds (a timm checkpoint's ``state_dict`` beside its ``state_dict_ema``)."""
    from safetensors import SafetensorError

    p = Path(path).expanduser()
    what = f"model.pretrained_file: {str(path)!r}"
    if not p.is_file():
        raise ValueError(f"{what} {'is a folder' if p.is_dir() else 'not found'} (give a weights file)")
    if p.stat().st_size > MAX_WEIGHTS_BYTES:
        raise ValueError(f"{what} is {p.stat().st_size / 2**30:.1f} GiB; the limit is {MAX_WEIGHTS_BYTES // 2**30} GiB")
    try:
        with open(p, "rb") as f:
            head = f.read(9)
        size = p.stat().st_size
        # a safetensors file: 8 bytes of header length, then the JSON header, whatever the file is named
        is_safetensors = len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= size - 8
        if p.suffix == ".safetensors" and not is_safetensors:
            torch_file = head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"  # a torch.save zip, a legacy pickle
            if torch_file:
                raise ValueError(f"{what} is a PyTorch (torch.save) file, not a safetensors file: name it .pth")
        if is_safetensors or p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(p))
        else:
            state = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        glob = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        why = (f"holds pickled objects other than tensors ({glob.group(1)}); it was not loaded: that could run code"
               if glob else "is a pickle that torch.save does not write (not a PyTorch or safetensors weights file)"
               if "Unsupported operand" in text or "weights_only" in text else "is corrupt")
        raise ValueError(f"{what} {why}") from None
    except ValueError as e:
        if str(e).startswith(what):
            raise
        raise _damaged(what, e) from None
    except (SafetensorError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, KeyError, IndexError, TypeError,
            AttributeError, OverflowError, MemoryError) as e:  # SafetensorError: a bad header, a truncated file
        raise _damaged(what, e) from None
    if isinstance(state, dict) and "config" in state and ("digest" in state or {"model", "step"} <= set(state)):
        raise ValueError(f"{what} is a visattn checkpoint: start from it with model.init_from={path}")
    entry, others = None, []
    if isinstance(state, dict):
        held = [k for k in WEIGHT_ENTRIES if isinstance(state.get(k), dict)]
        if held:
            entry, others = held[0], held[1:]
            state = state[entry]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{what} holds no state dict (a mapping of parameter names to tensors)")
    if all(isinstance(k, str) and k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    bad = next((k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if bad is not None:
        raise ValueError(f"{what} holds non-finite weights (NaN or inf in {bad})")
    return state, entry, others


def _classifier_names(model: nn.Module, num_classes: int) -> List[str]:
    """Module names of the classifier: timm's ``get_classifier()``, else the last linear layer (or 1x1 conv)
    with ``num_classes`` outputs (torchvision's ``fc``, ``classifier.3``, ``heads.head``...)."""
    get = getattr(model, "get_classifier", None)
    target = get() if callable(get) else None
    heads = [t for t in (target if isinstance(target, (tuple, list)) else (target,))  # levit: (head, head_dist)
             if isinstance(t, nn.Module) and not isinstance(t, nn.Identity)]
    if heads:
        return [n for n, m in model.named_modules() if any(m is t for t in heads)]
    last = [n for n, m in model.named_modules() if (isinstance(m, nn.Linear) and m.out_features == num_classes)
            or (isinstance(m, nn.Conv2d) and m.out_channels == num_classes)]
    return last[-1:]


def zero_classifier(model: nn.Module, num_classes: int, name: str) -> List[str]:
    """Zero the weight and bias of ``model``'s classifier (:func:`_classifier_names`: its linear and conv layers,
    not a norm a head module may hold); returns the names zeroed. A model whose classifier cannot be found is a
    ValueError."""
    names = _classifier_names(model, num_classes)
    modules = dict(model.named_modules())
    params = [p for n in names for m in modules[n].modules() if isinstance(m, (nn.Linear, nn.Conv2d))
              for p in m.parameters(recurse=False)]
    if not params:
        raise ValueError(f"model.head_init: found no classifier in {name} (no get_classifier(), no linear layer of "
                         f"{num_classes} outputs)")
    with torch.no_grad():
        for p in params:
            p.zero_()
    return names


def probe_size(model: nn.Module, kwargs: Dict[str, Any], cifar_stem: bool) -> int:
    """The side of a square input the built model takes: 32 with a CIFAR stem, else ``img_size`` from the
    options or the package's pretrained config, else 224."""
    size = kwargs.get("img_size")
    size = size[-1] if isinstance(size, (list, tuple)) and size else size
    cfg = getattr(model, "pretrained_cfg", None)
    if cifar_stem:
        return 32
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    return int(cfg["input_size"][-1]) if isinstance(cfg, dict) and cfg.get("input_size") else 224


def check_learns_from_zero(model: nn.Module, names: Sequence[str], size: int, name: str) -> None:
    """A ValueError where the zeroed classifier ``names`` gets no gradient from a cross-entropy loss on a probe
    batch (eval mode, a seeded generator, so no RNG or statistic of the run moves): something after it is flat
    at zero (torchvision's SqueezeNet: a ReLU after its classifier conv), so it would never leave zero. Nothing
    is said where the probe cannot run (the meta device, an input the model refuses)."""
    modules = dict(model.named_modules())
    params = [p for n in names for p in modules[n].parameters() if p.requires_grad]
    if not params or any(p.is_meta for p in params):
        return
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0)).to(params[0])
    training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            out = model(x)
            out = (out[0] if isinstance(out, (tuple, list)) else out).float()
            loss = nn.functional.cross_entropy(out, torch.arange(2, device=out.device) % out.shape[-1])
            grads = torch.autograd.grad(loss, params, allow_unused=True)
    except (RuntimeError, ValueError, TypeError, AssertionError, AttributeError, IndexError):
        return
    finally:
        model.train(training)
    if any(g is not None and bool(g.abs().sum() > 0) for g in grads):
        return
    parent_name, _, last = names[-1].rpartition(".")
    children = list(modules[parent_name].named_children()) if isinstance(modules[parent_name], nn.Sequential) else []
    keys = [k for k, _ in children]
    after = [type(m).__name__ for _, m in children[keys.index(last) + 1:]] if last in keys else []
    tail = f" (after it: {', '.join(after)})" if after else ""
    raise ValueError(f"model.head_init=zero: the classifier of {name} ({', '.join(names)}) gets no gradient at zero"
                     f"{tail}, so it would never leave zero; leave model.head_init unset for this model")


def check_patch_grid(model: nn.Module, name: str) -> None:
    """A ViT's patches must tile its image (Dosovitskiy et al. 2020, "An Image is Worth 16x16 Words", arXiv
    2010.11929: an H x W image is cut into HW/P^2 patches): timm's patch embedding at ``img_size=32`` and
    ``patch_size=7`` builds a 4x4 grid over 28 of the 32 pixels, the rest never seen; a ValueError."""
    embed = getattr(model, "patch_embed", None)
    img, patch = getattr(embed, "img_size", None), getattr(embed, "patch_size", None)
    if not (isinstance(img, (tuple, list)) and isinstance(patch, (tuple, list)) and len(img) == len(patch)):
        return
    if any(isinstance(i, int) and isinstance(p, int) and p > 0 and i % p for i, p in zip(img, patch)):
        seen = [i // p * p for i, p in zip(img, patch)]
        raise ValueError(f"model.kwargs: {name}'s patches of {patch[0]}x{patch[-1]} do not tile its {img[0]}x{img[-1]} "
                         f"image (a grid over {seen[0]}x{seen[-1]} pixels, the rest never seen); give a patch_size that "
                         "divides img_size")


def check_forward_runs(model: nn.Module, size: int, name: str) -> None:
    """On the meta device (a config's check: no memory, no values), one input through the built model: a model
    whose options build but do not fit together (timm's ResNet with 3 ``channels`` for its 4 stages has no
    ``layer4``) fails here in one line, not at the first image. Errors that depend on the input's size are
    left to the run's check on its own images."""
    if not all(p.is_meta for p in model.parameters()):
        return
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, size, size, device="meta"))
    except (AttributeError, KeyError, IndexError, NameError) as e:
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise ValueError(f"model.kwargs: {name} builds with these options, but its forward fails ({type(e).__name__}"
                         f"{': ' + why if why else ''}): the options do not fit together (a list of another length "
                         "than the model's stages?)") from None
    except Exception:  # noqa: BLE001 - a size the model refuses, an op without a meta kernel: the run's check
        pass
    finally:
        model.train(training)


def wide_head_note(model: nn.Module, num_classes: int, ratio: float = 3.0) -> Optional[str]:
    """A note when ``model``'s classifier weights are spread more than ``ratio`` times wider than PyTorch's default
    linear init for their input width (U(+-1/sqrt(fan_in)): 1x; torchvision's MobileNetV3 0.6x, timm's ResNets 1x),
    as timm's EfficientNet and MobileNetV3 families' are at few classes (U(+-1/sqrt(num_classes)): 11x for
    TinyNet-E at 10), so the first loss lies far above chance; None otherwise, or where no classifier is found."""
    modules = dict(model.named_modules())
    names = [n for n in _classifier_names(model, num_classes) if isinstance(getattr(modules[n], "weight", None), torch.Tensor)]
    if not names or modules[names[0]].weight.dim() < 2 or modules[names[0]].weight.is_meta:
        return None
    weight = modules[names[0]].weight.detach().float()
    fan_in = weight[0].numel()
    wide = weight.std().item() * math.sqrt(3 * fan_in)
    if not wide > ratio:
        return None
    return (f"note: the classifier ({names[0]}) starts {wide:.0f}x wider than PyTorch's default init for its {fan_in} "
            f"inputs (the package's own init, made for more classes), so the first loss lies far above chance's "
            f"{math.log(num_classes):.2f}; model.head_init=zero starts it at zero (docs/models.md)")


def _keys(ks: Sequence[str]) -> str:
    return ", ".join(ks[:3]) + (f" and {len(ks) - 3} more" if len(ks) > 3 else "")


def _head_split(state: Dict[str, torch.Tensor], own: Dict[str, torch.Tensor], head_keys: Sequence[str]
                ) -> Tuple[List[str], Optional[str]]:
    """The classifier keys to replace (kept fresh) because the file's classifier has another class count, or a
    reason the file's classifier does not fit (a half-mismatched head: one line, never half replaced)."""
    differ = [k for k in head_keys if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if not differ:
        return [], None
    count = [k for k in differ if state[k].dim() >= 1 and own[k].dim() >= 1 and state[k].shape[0] != own[k].shape[0]
             and tuple(state[k].shape[1:]) == tuple(own[k].shape[1:])]
    if len(count) < len(differ):  # another input width (maybe also another count): not a class-count change
        return [], None  # left to the shape check, which names each key with both shapes
    fits = [k for k in head_keys if k in state and k not in differ and own[k].dim() >= 1]
    classes = sorted({int(state[k].shape[0]) for k in count})
    if fits or len(classes) > 1:
        first = count[0]
        why = f"but {fits[0]} {list(state[fits[0]].shape)} fits" if fits else \
            f"and its tensors disagree on the class count ({', '.join(map(str, classes))})"
        return [], (f"its classifier is only partly of another class count ({first} {list(state[first].shape)} here "
                    f"{list(own[first].shape)}, {why}): a damaged or hand-edited file; nothing was replaced")
    return sorted(count), None


def load_pretrained(model: nn.Module, path: str, num_classes: int) -> Dict[str, Any]:
    """Load :func:`read_weights` into ``model``: the classifier is replaced (kept fresh) where every tensor of
    the file's has another class count (and only that); any other missing, unexpected, misshapen or
    integer-for-float key, or a classifier only partly of another class count, is a ValueError naming the
    file and the first keys. BatchNorm's ``num_batches_tracked`` counters may be absent (older torchvision
    files), as torch's own ``load_state_dict`` takes them. Returns what was done (for the run to say and record)."""
    (state, entry, others), own = read_weights_entry(path), model.state_dict()
    heads = tuple(f"{n}." for n in _classifier_names(model, num_classes))
    head_keys = [k for k in own if k.startswith(heads)]
    replaced, half = _head_split(state, own, head_keys)
    file_classes = int(state[replaced[0]].shape[0]) if replaced else None
    shape = {k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape)}
    state = {k: v for k, v in state.items() if k not in replaced}
    unexpected = [k for k in state if k not in own]
    missing = [k for k in own if k not in state and k not in replaced and not k.endswith(".num_batches_tracked")
               and k != "num_batches_tracked"]
    width = set(head_keys) & shape - set(replaced)
    said = set(replaced) | (set(head_keys) if half else set())  # a half-mismatched head is named once, by ``half``
    wrong = [f"{k} {list(state[k].shape)} here {list(own[k].shape)}" for k in sorted(shape - said)]
    kinds = [f"{k} ({str(state[k].dtype).removeprefix('torch.')})" for k in state
             if k in own and own[k].is_floating_point() and not state[k].is_floating_point()]
    problems = ([half] if half else []) + \
        ([f"its {_keys(unexpected)} have no place in this model"] if unexpected else []) + \
        ([f"this model's {_keys(missing)} are not in it"] if missing else []) + \
        ([f"shapes differ: {_keys(wrong)}" + (" (the classifier's input width differs, not only its class count)"
                                               if width else "")] if wrong else []) + \
        ([f"it holds integer (or bool) tensors where this model's weights are floating point: {_keys(kinds)}"]
         if kinds else [])
    if problems:
        raise ValueError(f"model.pretrained_file: {path} does not fit this model (another architecture, or other "
                         f"model.kwargs / cifar_stem?): {'; '.join(problems)}")
    if not any(t.is_meta for t in own.values()):  # a check on the meta device (nothing to load into) stops here
        model.load_state_dict(state, strict=False)
    return {"path": str(Path(path).expanduser().resolve()), "tensors": len(state), "replaced": replaced,
            "entry": entry, "other_entries": others, "file_classes": file_classes, "num_classes": num_classes}


# ---- the builder -----------------------------------------------------------------------------------------


def _build(package: str, arch: str, num_classes: int, kwargs: Dict[str, Any]) -> nn.Module:
    """The package's model; options it does not take, or rejects, are one line naming ``model.kwargs``."""
    try:
        model = package_model(package, arch, num_classes, kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError, KeyError, IndexError, ZeroDivisionError,
            OverflowError, AttributeError) as e:
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else e.__class__.__name__
        if kwargs and isinstance(e, TypeError) and "unexpected keyword" in why:
            import inspect

            with torch.device("meta"):
                plain = package_model(package, arch, num_classes, {})
            took = [p for p in inspect.signature(type(plain).__init__).parameters if p not in ("self", "args", "kwargs")]
            why = f"{why}; {type(plain).__name__} takes {', '.join(k for k in took if k not in RESERVED)}"
        raise ValueError(f"model.kwargs: {package}/{arch} refused {kwargs} ({why})") from None
    if getattr(model, "num_classes", num_classes) != num_classes:
        raise ValueError(f"{package}/{arch} is not a classifier of {num_classes} classes")
    return model


def build_foreign(package: str, arch: str, num_classes: int = 10, *, attention: str = "none",
                  attn_kwargs: Optional[Dict[str, Any]] = None, attn_at: Union[str, List[str], None] = None,
                  cifar_stem: bool = False, kwargs: Optional[Dict[str, Any]] = None,
                  pretrained_file: Optional[str] = None, bn_momentum: Optional[float] = None,
                  head_init: Optional[str] = None) -> nn.Module:
    """``package``'s model ``arch`` (see the module docstring); ``model.pretrained_origin`` records a
    ``pretrained_file`` load (the file, the tensors loaded, the classifier keys replaced). ``bn_momentum``: the
    running-statistics momentum of every BatchNorm of the model (not of the blocks inserted after), instead of
    the package's (torchvision's MobileNetV3 and timm's ``tf_`` ports use 0.01, made for hundreds of epochs).
    ``head_init="zero"``: the classifier starts at zero (:data:`visattn.own_options.HEAD_INITS`), before a ``pretrained_file`` loads,
    so a file's classifier of this class count is kept and a replaced one starts at zero."""
    options = {"attention": attention, "attn_kwargs": attn_kwargs, "attn_at": attn_at, "cifar_stem": cifar_stem,
               "kwargs": kwargs, "pretrained_file": pretrained_file, "bn_momentum": bn_momentum, "head_init": head_init}
    check_options(package, resolve(package, arch), {k: v for k, v in options.items() if v is not None})
    model = _build(package, arch, num_classes, dict(kwargs or {}))
    if cifar_stem:
        apply_cifar_stem(model, f"{package}/{arch}")
    if bn_momentum is not None:
        for m in model.modules():
            if isinstance(m, BATCH_NORMS):
                m.momentum = float(bn_momentum)
    check_patch_grid(model, f"{package}/{arch}")
    size = probe_size(model, dict(kwargs or {}), cifar_stem)
    check_forward_runs(model, size, f"{package}/{arch}")
    if head_init == "zero":
        check_learns_from_zero(model, zero_classifier(model, num_classes, f"{package}/{arch}"), size, f"{package}/{arch}")
    model.pretrained_origin = load_pretrained(model, pretrained_file, num_classes) if pretrained_file else None
    if attention != "none":
        try:
            insert_attention(model, attention, at=attn_at, **dict(attn_kwargs or {}))
        except (ValueError, TypeError) as e:
            if attn_at is None and "found no residual blocks" in str(e):
                e = ValueError(f"insert_attention found no residual branch or SE slot in {type(model).__name__} "
                               "(docs/models.md lists what takes a block); name the modules to follow with "
                               "model.attn_at=[NAME, ...] (patterns of model.named_modules(), each a conv or norm "
                               "of (B, C, H, W) output)")
            raise ValueError(f"model.attention={attention} in {package}/{arch}: {e}") from None
    elif attn_kwargs or attn_at:
        raise ValueError(f"model.attn_kwargs / attn_at are set but model.attention is none ({package}/{arch})")
    return model


def without_weights(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` less ``pretrained_file``: for rebuilding a model whose weights come from a checkpoint."""
    return {k: v for k, v in options.items() if k != "pretrained_file"}



for _package in PACKAGES:
    MODELS.register_namespace(_package, functools.partial(build_foreign, _package),
                              resolve=functools.partial(resolve, _package),
                              check=functools.partial(check_options, _package))
