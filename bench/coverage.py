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
"""
from __future__ import annotations

import json
import time
import warnings
from typing import Any, Dict, List, Optional

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


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser(__doc__.split("\n\n")[0], threads=True)
    ap.add_argument("--write", action="store_true", help="write the results file and the docs table")
    ap.add_argument("--table", action="store_true", help="print the table from the results file")
    ap.add_argument("--docs", action="store_true", help="rewrite the docs table and README claim from the results file")
    ap.add_argument("--only", nargs="+", default=None, help="these architectures only (printed)")
    args = ap.parse_args(argv)
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
