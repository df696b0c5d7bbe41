"""Which architectures of timm and torchvision take visattn's blocks by the default rule, one row each.

For each architecture of :data:`ARCHS` (the smallest model of each family in timm 1.0.31 and torchvision 0.29.1,
random weights, 10 classes): ``insert_attention(model, "cbam")`` by the default rule (the sites found in the
model's forward, :mod:`visattn.attention.structure`), then

* ``sites``: how many blocks went in (0 where it refused, with ``refusal``, its one line);
* ``identity``: the model computes bit for bit what it did before, in eval mode (the blocks start as the identity);
* ``backward``: a training-mode forward and backward give every new block finite gradients;
* ``maps``: how many maps ``visattn.maps.record_attention`` records in one pass of the model *as built* (its own
  attention: transformers), ``None`` where it records nothing or fails;
* ``rule``: ``"family"`` where every site is a family rule's, ``"structure"`` where some are the structural rule's.

``python -m bench.coverage --write`` writes ``bench/results/coverage.json`` (with the command, git revision and
timm / torchvision versions), the table in docs/models.md between its markers and the README's claim ("blocks go
into N of M architectures"); ``--table`` prints the table from the results file, ``--docs`` rewrites the table
and the claim from it; ``--only NAME ...`` runs some rows (printed, nothing written).

``python -m bench.coverage --maps`` writes docs/maps.md's transformer coverage table (:func:`map_rows`: one row
per family of :data:`visattn.maps.families.FAMILIES` and per module the recorder taps itself, each recorded on
a tiny random-weight model in seconds, and one line per family that cannot be recorded, saying why), and ``--sweep`` builds every classifier name of timm and torchvision and reports any that crashes
``insert_attention`` or ``record_attention`` instead of working or refusing in one line.
"""
from __future__ import annotations

import json
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from bench.common import ROOT, parser, provenance, splice

RESULTS = ROOT / "bench" / "results" / "coverage.json"
DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- coverage: python -m bench.coverage --write -->", "<!-- /coverage -->"
README = ROOT / "README.md"

# the smallest model of each family (timm 1.0.31, torchvision 0.29.1)
TIMM = (
    "resnet18 resnext50_32x4d wide_resnet50_2 regnetx_002 regnety_002 convnext_atto efficientnet_b0 "
    "efficientnetv2_rw_t mobilenetv2_050 mobilenetv3_small_050 mnasnet_small hrnet_w18_small tinynet_e "
    "resnest14d res2net50_14w_8s skresnet18 tresnet_m nf_resnet26 resnext26ts repvgg_a0 mobileone_s0 gernet_s "
    "mobilevit_xxs cspresnet50 cspdarknet53 darknet17 dla46_c dla34 dpn48b rexnet_100 ghostnet_050 ghostnetv2_100 "
    "repghostnet_050 lcnet_050 mobilenetv4_conv_small ese_vovnet19b_dw hgnet_tiny hgnetv2_b0 rdnet_tiny "
    "starnet_s050 edgenext_xx_small poolformer_s12 poolformerv2_s12 fastvit_t8 xception41 legacy_xception "
    "selecsls42b legacy_seresnet18 mixnet_s regnetz_b16 convmixer_768_32 inception_v3 efficientformer_l1 "
    "vgg11 densenet121 vit_tiny_patch16_224 deit_tiny_patch16_224 pit_ti_224 swin_tiny_patch4_window7_224 "
    "cait_xxs24_224 xcit_nano_12_p16_224 convit_tiny coat_lite_tiny levit_128s tiny_vit_5m_224 efficientvit_b0 "
    "maxvit_tiny_tf_224 nest_tiny"
).split()
TORCHVISION = (
    "resnet18 resnext50_32x4d wide_resnet50_2 regnet_x_400mf regnet_y_400mf convnext_tiny efficientnet_b0 "
    "efficientnet_v2_s mobilenet_v2 mobilenet_v3_small mnasnet0_5 shufflenet_v2_x0_5 vgg11 alexnet squeezenet1_0 "
    "densenet121 googlenet vit_b_16 swin_t maxvit_t"
).split()
ARCHS = [f"timm/{a}" for a in TIMM] + [f"torchvision/{a}" for a in TORCHVISION]


def build(arch: str) -> nn.Module:
    """``arch`` ("timm/NAME" or "torchvision/NAME") with random weights and 10 classes."""
    package, name = arch.split("/", 1)
    if package == "timm":
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10)
    import torchvision

    kwargs = {"aux_logits": False, "init_weights": False} if name in ("googlenet", "inception_v3") else {}
    return torchvision.models.get_model(name, weights=None, num_classes=10, **kwargs)


def probe(model: nn.Module) -> torch.Tensor:
    """An input the model runs on: 64 px where it takes it, else its configured size (224 px)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    for size in (64, tuple(cfg.get("input_size", (3, 224, 224)))[-1], 224, 299):
        x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
        try:
            with torch.no_grad():
                model.eval()(x)
            return x
        except Exception:  # noqa: BLE001 - the next size
            continue
    raise RuntimeError("runs on no probe size (64, 224, 299)")


def _maps(model: nn.Module, x: torch.Tensor) -> Optional[int]:
    from visattn.maps import record_attention

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad(), record_attention(model, warn=False) as rec:
                model.eval()(x[:1])
        return len(rec) or None
    except Exception:  # noqa: BLE001 - recorded as none; the row says nothing more about maps
        return None


def _insert(model: nn.Module, rule: str) -> int:
    import copy

    from visattn import insert_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return insert_attention(copy.deepcopy(model) if rule == "family" else model, "cbam", rule=rule)
        except ValueError:
            if rule == "family":
                return 0
            raise


def _backward_ok(model: nn.Module, x: torch.Tensor) -> bool:
    from visattn.attention.spatial import CBAM

    model.train()
    model(x).float().logsumexp(1).sum().backward()
    blocks = [m for m in model.modules() if isinstance(m, CBAM)]
    grads = [p.grad for b in blocks for p in b.parameters()]
    return bool(blocks) and all(g is not None and torch.isfinite(g).all() for g in grads)


def row(arch: str) -> Dict[str, Any]:
    """One architecture's row (module docstring)."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    out: Dict[str, Any] = {"arch": arch, "sites": 0, "identity": None, "backward": None, "refusal": None,
                           "rule": None, "maps": None}
    try:
        model = build(arch)
        x = probe(model)
        out["maps"] = _maps(model, x)
        with torch.no_grad():
            before = model.eval()(x)
        family = _insert(model, "family")
        try:
            out["sites"] = _insert(model, "auto")
        except ValueError as e:
            out["refusal"] = str(e).splitlines()[0]
        if out["sites"]:
            with torch.no_grad():
                out["identity"] = bool(torch.equal(model.eval()(x), before))
            out["backward"] = _backward_ok(model, x)
            out["rule"] = "family" if family == out["sites"] else "structure"
    except Exception as e:  # noqa: BLE001 - a crash is a row too: the table shows it
        out["refusal"] = f"crash: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def table(data: Dict[str, Any]) -> str:
    """The docs table from a results file's contents."""
    rows = data["rows"]
    placed = sum(1 for r in rows if r["sites"] and r["identity"] and r["backward"])
    lines = [f"Blocks go in by the default rule in **{placed} of {len(rows)}** architectures (timm {data['timm']}, "
             f"torchvision {data['torchvision']}, random weights; `{data['command']}` at {data['git']}). "
             "*sites*: blocks put; *identity*: the model computes bit for bit what it did before; *backward*: "
             "every block gets finite gradients; *rule*: `family` where the family rules alone give the same "
             "sites, `structure` where the structural rule finds them; *maps*: records "
             "`record_attention` takes of the model's own attention in one pass.", "",
             "| architecture | sites | identity | backward | rule | maps | refusal |", "|---|---:|---|---|---|---:|---|"]
    for r in rows:
        flag = {True: "yes", False: "**no**", None: ""}
        refusal = (r["refusal"] or "").replace("|", "\\|")
        lines.append(f"| `{r['arch']}` | {r['sites']} | {flag[r['identity']]} | {flag[r['backward']]} | "
                     f"{r['rule'] or ''} | {r['maps'] or ''} | {refusal[:140] + ('...' if len(refusal) > 140 else '')} |")
    return "\n".join(lines)


def claim(data: Dict[str, Any]) -> str:
    """The README's one-line claim, from the results file."""
    rows = data["rows"]
    placed = sum(1 for r in rows if r["sites"] and r["identity"] and r["backward"])
    return f"blocks go into {placed} of {len(rows)} architectures"


def write_docs(data: Dict[str, Any]) -> None:
    """The docs table and the README's claim, from a results file's contents."""
    import re

    splice(DOC, BEGIN, END, table(data))
    text = README.read_text()
    new = re.sub(r"blocks go into \d+ of \d+ architectures", claim(data), text)
    if new != text:
        README.write_text(new)


# ---- docs/maps.md: which transformer families record_attention records (python -m bench.coverage --maps)

MAPS_DOC = ROOT / "docs" / "maps.md"
MAPS_BEGIN, MAPS_END = "<!-- families: python -m bench.coverage --maps -->", "<!-- /families -->"
Example = Tuple[str, Callable[[], nn.Module], int]  # (what it is, a builder, input size)


def _timm(name: str, size: int, **kwargs: Any) -> Example:
    import timm

    shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    return (f"`timm/{name}`{f' ({shown})' if shown else ''}",
            lambda: timm.create_model(name, pretrained=False, num_classes=10, **kwargs), size)


def _tv_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                             num_classes=10)


def _tv_swin(v2: bool) -> nn.Module:
    from torchvision.models import swin_transformer as sw

    extra = {"block": sw.SwinTransformerBlockV2, "downsample_layer": sw.PatchMergingV2} if v2 else {}
    return sw.SwinTransformer([4, 4], 16, [2, 2], [1, 2], [4, 4], num_classes=10, **extra)


def _tv_maxvit() -> nn.Module:
    from torchvision.models.maxvit import MaxVit

    return MaxVit(input_size=(64, 64), stem_channels=16, partition_size=4, block_channels=[16, 32],
                  block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0, num_classes=10)


def _maxxvit(key: str, nchw: bool) -> nn.Module:
    from dataclasses import replace

    from timm.models import maxxvit

    cfg = maxxvit.model_cfgs[key]
    cfg = replace(cfg, embed_dim=(16, 32), depths=(1, 1), stem_width=16,
                  transformer_cfg=replace(cfg.transformer_cfg, use_nchw_attn=nchw, dim_head=8))
    return maxxvit.MaxxVit(cfg, img_size=64, num_classes=10)


TV = "torchvision"
MAP_EXAMPLES: Tuple[Example, ...] = (  # tiny random-weight models, one or more per recorded family
    _timm("vit_tiny_patch16_224", 32, img_size=32, patch_size=4, depth=2),
    _timm("deit_tiny_distilled_patch16_224", 32, img_size=32, patch_size=4, depth=2),
    _timm("pit_ti_224", 32, img_size=32, patch_size=4, stride=2),
    (f"{TV} `VisionTransformer` (32 px, patch 8, 2 layers, width 16)", _tv_vit, 32),
    _timm("swin_tiny_patch4_window7_224", 32, img_size=32, window_size=4, embed_dim=16, depths=(2, 2),
          num_heads=(1, 2)),
    _timm("swinv2_tiny_window8_256", 32, img_size=32, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(1, 2)),
    (f"{TV} `SwinTransformer` (patch 4, width 16, depths 2-2, window 4)", lambda: _tv_swin(False), 32),
    (f"{TV} `SwinTransformer` v2 blocks (patch 4, width 16, depths 2-2, window 4)", lambda: _tv_swin(True), 32),
    _timm("tiny_vit_5m_224", 64),
    ("`timm` MaxxVit, `maxvit_nano_rw` config (widths 16-32, depths 1-1)", lambda: _maxxvit("maxvit_nano_rw", False), 64),
    ("`timm` MaxxVit, `maxvit_nano_rw` config with `use_nchw_attn` (widths 16-32, depths 1-1)",
     lambda: _maxxvit("maxvit_nano_rw", True), 64),
    _timm("efficientvit_m0", 128, img_size=128),
    (f"{TV} `MaxVit` (64 px, partition 4, widths 16-32, 1-1 layers)", _tv_maxvit, 64),
    _timm("cait_xxs24_224", 32, img_size=32, patch_size=4, depth=2),
    _timm("convit_tiny", 32, img_size=32, patch_size=4, depth=3, local_up_to_layer=2),
    _timm("levit_128s", 64, img_size=64),
    _timm("fastvit_sa12", 64),
    _timm("xcit_nano_12_p16_224", 32, img_size=32, patch_size=8, depth=2),
    _timm("edgenext_xx_small", 64),
    _timm("coat_lite_tiny", 64, img_size=64),
    _timm("mobilevit_xxs", 64),
    _timm("mobilevitv2_050", 64),
)
# the modules the recorder taps itself (visattn.maps.record), beside the families' registry
BASE = {
    ("timm.layers.attention", "Attention"): ("ViT, DeiT, PiT (timm `Attention`)",
                                             "class token(s) first, then the patch grid"),
    ("torch.nn.modules.activation", "MultiheadAttention"): (f"{TV} ViT (`nn.MultiheadAttention`)",
                                                            "class token first, then the patch grid"),
}
UNRECORDABLE_EXAMPLES: Dict[Tuple[str, str], Example] = {
    ("timm.models.efficientvit_mit", "LiteMLA"): _timm("efficientvit_b0", 64),
    ("timm.models.maxxvit", "ParallelPartitionAttention"): (
        "`timm` MaxxVit, `maxvit_tiny_pm` config (widths 16-32, depths 1-1)", lambda: _maxxvit("maxvit_tiny_pm", False), 64),
}
# transformer families whose attention module nothing records yet: (label, a model, its attention module)
NOT_YET = (
    ("BEiT", "beit_base_patch16_224", ("timm.models.beit", "Attention")),
    ("EVA, EVA-02", "eva02_tiny_patch14_224", ("timm.models.eva", "EvaAttention")),
    ("DaViT", "davit_tiny", ("timm.models.davit", "WindowAttention")),
    ("GCViT", "gcvit_xxtiny", ("timm.models.gcvit", "WindowAttentionGlobal")),
    ("Hiera", "hiera_tiny_224", ("timm.models.hiera", "MaskUnitAttention")),
    ("MViT v2", "mvitv2_tiny", ("timm.models.mvitv2", "MultiScaleAttention")),
    ("NesT", "nest_tiny", ("timm.models.nest", "Attention")),
    ("PVT v2", "pvt_v2_b0", ("timm.models.pvt_v2", "Attention")),
    ("Twins", "twins_svt_small", ("timm.models.twins", "LocallyGroupedAttn")),
    ("TNT", "tnt_s_patch16_224", ("timm.models.tnt", "Attention")),
    ("VOLO", "volo_d1_224", ("timm.models.volo", "OutlookAttention")),
    ("EfficientFormer v2", "efficientformerv2_s0", ("timm.models.efficientformer_v2", "Attention2d")),
    ("Swin v2 CR", "swinv2_cr_tiny_224", ("timm.models.swin_transformer_v2_cr", "WindowMultiHeadAttention")),
    ("ViT with relative positions", "vit_relpos_small_patch16_224",
     ("timm.models.vision_transformer_relpos", "RelPosAttention")),
    ("SAM ViT", "samvit_base_patch16", ("timm.models.vision_transformer_sam", "Attention")),
    ("Next-ViT", "nextvit_small", ("timm.models.nextvit", "EfficientAttention")),
)


def _key(model: nn.Module, name: str) -> Any:
    """The registry entry (a Family) or the tapped class (:data:`BASE`) that recorded ``name``."""
    from visattn.maps import families

    path = name.split("@")[0]
    module = model.get_submodule(path)
    return families.family_of(model, path, module) or (type(module).__module__, type(module).__name__)


def _shape(r: Any) -> str:
    """A record's kind and the axes of its weights (``N``: the grid's cells, after the prefix tokens)."""
    tokens = "N" if not r.num_prefix_tokens else f"{r.num_prefix_tokens}+N"
    if r.kind == "covariance":
        return "covariance `(B, h, d, d)`"
    if r.kind == "pool":
        return f"pool `(B, {tokens})`"
    q, k = r.weights.shape[-2:]
    query = tokens if q == k else ("1" if q == 1 else "Nq")
    return f"{r.kind} `(B, h, {query}, {tokens})`"


def _cells(maps: List[Any], size: int) -> str:
    """The grids a family's maps lie on at the example's input size, from the maps' own geometry."""
    out: List[str] = []
    for m in maps:
        g = m.geometry
        words = ("channel x channel, not placed" if not m.placed else
                 f"{g.size[0]}x{g.size[1]}, stride {g.stride[0]:g} px" + ("" if g.exact else " (stretched)"))
        if words not in out:
            out.append(words)
    return f"at {size} px: {'; '.join(out)}" if out else ""


def _record_example(example: Example) -> Tuple[nn.Module, List[Any], List[Any], bool, List[str]]:
    """One example recorded: (model, records, maps, output unchanged bit for bit, warning lines)."""
    from visattn.maps import read_maps, record_attention

    _, build_it, size = example
    torch.manual_seed(0)
    model = build_it().eval()
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = model(x)
        with record_attention(model) as rec:
            during = model(x)
        maps = read_maps(rec.records, model, x.shape, rollout=False, gradients=False, matrices=True)
    return model, rec.records, maps, bool(torch.equal(before, during)), [str(w.message) for w in caught]


def map_rows() -> Dict[str, Any]:
    """Every example recorded: one row per registry entry and per tapped class, and one per family that cannot
    be recorded (module docstring); ``rows[i]["records"]`` is 0 where an entry recorded nothing."""
    from visattn.maps import families

    entries: List[Any] = list(BASE) + list(families.FAMILIES) + [families.MOBILEVIT]
    rows: Dict[int, Dict[str, Any]] = {}
    for example in MAP_EXAMPLES:
        model, records, maps, same, _ = _record_example(example)
        for key in dict.fromkeys(_key(model, r.name) for r in records):
            mine = [r for r in records if _key(model, r.name) == key]
            i = entries.index(key)
            label, where = BASE[key] if key in BASE else (key.label, key.where)
            classes = [key] if key in BASE else list(key.modules)
            row = rows.setdefault(i, {"family": label, "modules": [f"{m}.{c}" for m, c in classes], "checked": [],
                                      "record": [], "where": where})
            row["checked"].append({"example": example[0], "records": len(mine), "unchanged": same,
                                   "cells": _cells([m for m in maps if any(m.record is r for r in mine)], example[2])})
            row["record"] += [t for t in dict.fromkeys(map(_shape, mine)) if t not in row["record"]]
    missing = [entries[i] for i in range(len(entries)) if i not in rows]
    for key in missing:  # a registry entry no example reaches: a row that says so (the test fails on it)
        label = BASE[key][0] if key in BASE else key.label
        rows[entries.index(key)] = {"family": label, "modules": [], "checked": [], "record": [], "where": ""}
    refused = []
    for (module, cls), why in families.UNRECORDABLE.items():
        example = UNRECORDABLE_EXAMPLES[(module, cls)]
        model, records, _, same, said = _record_example(example)
        present = any((type(m).__module__, type(m).__name__) == (module, cls) for m in model.modules())
        refused.append({"module": f"{module}.{cls}", "example": example[0], "present": present,
                        "records": len(records), "why": why, "said": any(why in line for line in said)})
    return {"rows": [rows[i] for i in sorted(rows)], "refused": refused}


def maps_table(data: Dict[str, Any]) -> str:
    """docs/maps.md's coverage table from :func:`map_rows`."""
    lines = ["Generated by `python -m bench.coverage --maps` from the registry (`visattn.maps.families.FAMILIES`, "
             "and the modules `record_attention` taps itself), each row checked by recording the model named, "
             "random weights: *checked on*: each model, the records of one pass (2 images) and the grids its maps "
             "lie on at that input size (traced from the model; *stretched*: a grid whose placement the trace could "
             "not derive, spread evenly over the image); the model's output is bit for bit unchanged while recording "
             "unless the row says otherwise; *record*: the kind and axes of the weights (`N`: the grid's cells, after "
             "the class tokens).", "",
             "| family (timm unless said) | module recorded | checked on: records, cells | record | where its cells lie |",
             "|---|---|---|---|---|"]
    for r in data["rows"]:
        modules = ", ".join(f"`{m.rsplit('.', 1)[1]}`" for m in r["modules"])
        checked = "<br>".join(f"{c['example']}: **{c['records']}**, {c['cells']}"
                              + ("" if c["unchanged"] else " (**output changed**)") for c in r["checked"])
        lines.append(f"| {r['family']} | {modules} | {checked or '**not checked**'} | {'; '.join(r['record'])} | "
                     f"{r['where']} |")
    lines += ["", f"**Not recorded** ({len(data['refused'])} kinds of module; `record_attention` says why in its "
              "one-line warning):", ""]
    for r in data["refused"]:
        checked = f"{r['example']}: {r['records']} records" if r["present"] else f"{r['example']}: **module absent**"
        lines.append(f"- `{r['module']}` ({checked}): {r['why']}")
    lines += ["", f"**Not recorded yet** ({len(NOT_YET)} families whose attention module no registry entry names; "
              "the model records nothing and the warning says what was searched): "
              + ", ".join(f"{label} (`{cls}`)" for label, _, (_, cls) in NOT_YET) + "."]
    return "\n".join(lines)


def not_yet_check() -> List[str]:
    """One line per :data:`NOT_YET` family that does record now, or whose module its model lacks (slow: builds
    each family's smallest model)."""
    import timm

    from visattn.maps import record_attention

    bad = []
    for label, name, cls in NOT_YET:
        model = timm.create_model(name, pretrained=False, num_classes=10).eval()
        if not any((type(m).__module__, type(m).__name__) == cls for m in model.modules()):
            bad.append(f"{label}: timm/{name} has no {cls[0]}.{cls[1]}")
            continue
        x = probe(model)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with record_attention(model, warn=False) as rec:
                model(x[:1])
        if len(rec):
            bad.append(f"{label}: timm/{name} records {len(rec)} now")
    return bad


# ---- the whole zoo: python -m bench.coverage --sweep all (or modules)


def sweep_names(which: str) -> List[str]:
    """Every classifier name of timm and torchvision (``"all"``), or the one with the fewest parameters of each
    timm module and every torchvision classifier (``"modules"``)."""
    import timm
    import torchvision.models as tvm

    tv = [f"torchvision/{n}" for n in tvm.list_models(module=tvm)]
    if which == "all":
        return [f"timm/{n}" for n in timm.list_models()] + tv
    picked = []
    for module in timm.list_modules():
        names = timm.list_models(module=module)
        sizes = {n: _params(f"timm/{n}") for n in names}
        picked.append(f"timm/{min(names, key=lambda n: (sizes[n] is None, sizes[n] or 0, n))}")
    return picked + tv


def _params(arch: str) -> Optional[int]:
    """The parameter count of ``arch``, built on the meta device (no memory, no init work); None where it fails."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sum(p.numel() for p in build(arch).parameters())
    except Exception:  # noqa: BLE001 - counted the slow way, by building it
        return None


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def sweep_row(arch: str, max_params: int) -> Dict[str, Any]:
    """``arch`` built with random weights: ``record`` (records of one pass at a tiny input, 0: nothing recorded),
    ``insert`` (blocks put by the default rule, 0: refused in one line), ``crash`` (what of visattn's raised
    otherwise, or a refusal of more than one line), or ``skipped`` (over ``max_params``, or the package
    cannot build or run it at all: not visattn's)."""
    from visattn import insert_attention
    from visattn.maps import record_attention

    out: Dict[str, Any] = {"arch": arch, "params": _params(arch), "record": None, "insert": None, "crash": None,
                           "skipped": None}
    if out["params"] is not None and out["params"] > max_params:
        out["skipped"] = f"{out['params'] / 1e6:.0f}M parameters (over --max-params)"
        return out
    t0 = time.perf_counter()
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build(arch)
            x = probe(model)[:1]
    except Exception as e:  # noqa: BLE001 - the package's own failure, not visattn's
        out["skipped"] = f"the package cannot build or run it: {_one_line(e)}"
        return out
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with record_attention(model.eval(), warn=False) as rec:
                model(x)
        out["record"] = len(rec)
    except Exception as e:  # noqa: BLE001 - a crash is what the sweep looks for
        out["crash"] = f"record_attention: {_one_line(e)}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["insert"] = insert_attention(model, "cbam")
    except ValueError as e:
        out["insert"] = 0
        if "\n" in str(e):
            out["crash"] = out["crash"] or f"insert_attention refused in {len(str(e).splitlines())} lines"
    except Exception as e:  # noqa: BLE001
        out["crash"] = out["crash"] or f"insert_attention: {_one_line(e)}"
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def sweep(names: List[str], max_params: int) -> int:
    """Print a row per name and a summary; 1 where any crashed."""
    rows = []
    for arch in names:
        rows.append(sweep_row(arch, max_params))
        print(json.dumps(rows[-1]), flush=True)
    crashed = [r for r in rows if r["crash"]]
    done = [r for r in rows if not r["skipped"]]
    print(f"{len(names)} architectures: {len(done)} checked ({sum(1 for r in done if r['insert'])} take blocks, "
          f"{sum(1 for r in done if r['record'])} record their own attention), "
          f"{len(rows) - len(done)} skipped, {len(crashed)} crashed" + "".join(f"\n  {r['arch']}: {r['crash']}" for r in crashed))
    return 1 if crashed else 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser(__doc__.split("\n\n")[0], threads=True)
    ap.add_argument("--write", action="store_true", help="write the results file and the docs table")
    ap.add_argument("--table", action="store_true", help="print the table from the results file")
    ap.add_argument("--docs", action="store_true", help="rewrite the docs table and README claim from the results file")
    ap.add_argument("--only", nargs="+", default=None, help="these architectures only (printed)")
    ap.add_argument("--maps", action="store_true", help="record each transformer family on a tiny model and write "
                    "docs/maps.md's coverage table (and check the families not recorded yet record nothing)")
    ap.add_argument("--sweep", choices=("all", "modules"), default=None,
                    help="every classifier name of timm and torchvision (all), or the smallest of each timm module and "
                    "every torchvision classifier (modules; --only: these names): does insert_attention or "
                    "record_attention crash? (printed, nothing written)")
    ap.add_argument("--max-params", type=float, default=1e8, help="--sweep skips larger models (default 1e8)")
    args = ap.parse_args(argv)
    if args.sweep:
        return sweep(args.only or sweep_names(args.sweep), int(args.max_params))
    if args.maps:
        data = map_rows()
        splice(MAPS_DOC, MAPS_BEGIN, MAPS_END, maps_table(data))
        print(maps_table(data))
        bad = not_yet_check()
        for line in bad:
            print(f"not recorded yet, but: {line}")
        return 1 if bad else 0
    if args.table or args.docs:
        data = json.loads(RESULTS.read_text())
        write_docs(data) if args.docs else print(table(data))
        return 0
    import timm
    import torchvision

    archs = args.only or ARCHS
    rows = []
    for arch in archs:
        r = row(arch)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.write and not args.only:
        data = {**provenance(), "timm": timm.__version__, "torchvision": torchvision.__version__, "rows": rows}
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
        write_docs(data)
        print(claim(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
