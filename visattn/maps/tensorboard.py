"""Log a model's attention maps to TensorBoard from one probe forward pass.

Tags (stable across steps, so TensorBoard's step slider walks through training, on a fixed colour scale):

* ``maps/<layer>``: spatial gates, token attention (class-token row, or attention received averaged over
  queries without a class token) and pooling weights, as overlays;
* ``maps/<layer>/cls_head<i>``: each head's class-token row, for token layers with a class token;
* ``maps/rollout``: attention rollout through the last run of token layers on one grid;
* ``maps/<layer>/grad`` and ``maps/rollout_grad`` (``gradient_maps=True``, the default): the gate or attention
  weighted by its gradient for the true class (the predicted one without labels), and Chefer et al.'s
  gradient-weighted rollout, from one backward pass over the probe (:func:`~visattn.maps.record.probe_pass`),
  as shares of the positive evidence on the relative scale; ``maps/layers_grad``: for a CNN with blocks at
  more than one resolution, those ``/grad`` maps joined on the pixels (:func:`~visattn.maps.readout.fuse_layers`);
* ``matrix/<layer>``: the first probe image's token-by-token attention (mean over heads), with axes;
* ``channel/<layer>`` (histograms): channel gate values;
* ``maps/descriptions`` (text tab): one line per tag: what the map is, its scale and its grid;
* ``faithfulness/<map>/deletion`` and ``/insertion`` (scalars, with ``faithfulness=True``): the probe's
  deletion and insertion scores against random orders (:func:`visattn.faithfulness`), and ``faithfulness/centre/``
  the same for the centre prior (a Gaussian on the image centre, the same for every image: the score a map must
  beat to say more than "the object is in the middle"); each map's card then also says its scores with their
  intervals under its pictures, and its paired difference to the centre prior (green: better, interval included;
  red: worse), and so does its line in the text tab.

Every ``maps/`` picture lays the probe images out in as many columns as fit TensorBoard's default card
(:data:`~visattn.maps.draw.MAX_WIDTH`): per image the true and predicted class (green when right, red when
wrong) and the map's range and peakedness above the original and its overlay, each cell drawn over the
input pixels it sees; a colour bar with the scale's ticks below. A map with a NaN or inf is skipped with a
warning.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..attention.tap import AttentionRecord
from .draw import DIM, GAP, RIGHT, TEXT, WRONG, Line, label_lines, map_picture, matrix_picture
from .faithful import PRIOR
from .overlay import images_to_float
from .readout import GRADIENT_KINDS, HEAD_MAPS, LayerMap, channel_records, named_records, read_maps
from .record import probe_pass
from .scale import check_norm, scale_title, to_unit

# small settings for a probe batch: 4x4 squares removed 4 at a time, 2 random orders per image; the centre prior
# scored beside the maps (a fixed map: no backward pass, only its curves), so each card can say whether its map
# beats it
FAITHFULNESS_PROBE = {"steps": 4, "regions": 4, "draws": 2, "bootstrap_draws": 200, "sanity": False,
                      "baselines": (PRIOR,)}


def _labels(logits: Any, labels: Optional[torch.Tensor], b: int, class_names, width: int) -> List[List[Line]]:
    preds = logits.argmax(-1).tolist() if isinstance(logits, torch.Tensor) and logits.dim() == 2 else [None] * b
    trues = labels.tolist() if labels is not None else [None] * b

    def name_of(i):
        if i is None:
            return "?"
        return str(class_names[i]) if class_names is not None and 0 <= i < len(class_names) else str(i)

    out = []
    for t, p in zip(trues, preds):
        colour = TEXT if t is None or p is None else (RIGHT if t == p else WRONG)
        out.append([(line, colour) for line in label_lines(name_of(t), name_of(p), width)])
    return out


def _matrix(writer: Any, r: AttentionRecord, name: str, step: int, caption: List[Line], norm: str,
            colormap: str, summary: Dict[str, List[str]], about: Dict[str, str]) -> None:
    w = r.weights[0].mean(0)  # (Nq, Nk), first probe image, mean over heads
    tag = f"matrix/{name}"
    if not torch.isfinite(w).all():
        warnings.warn(f"log_attention_maps: {tag} has NaN or inf weights at step {step}; picture skipped",
                      RuntimeWarning)
        summary["skipped"].append(tag)
        return
    unit = to_unit(w[None], "relative", int(w.shape[-1]), norm)[0]
    writer.add_image(tag, matrix_picture(unit, r.num_prefix_tokens, caption, "relative", norm, colormap), step,
                     dataformats="HWC")
    summary["images"].append(tag)
    about[tag] = (f"first probe image's token-by-token attention of {name}, mean over heads (rows: query tokens, "
                  f"columns: key tokens{', class token marked' if r.num_prefix_tokens else ''}); scale: "
                  f"{scale_title('relative', norm)}")


def _describe(writer: Any, about: Dict[str, str], step: int) -> None:
    rows = "\n".join(f"| `{tag}` | {text} |" for tag, text in about.items())
    writer.add_text("maps/descriptions", "| tag | what it shows |\n|---|---|\n" + rows, step)


def faithfulness_notes(row: Any, images: int, versus_prior: Sequence[Any]) -> List[Line]:
    """The lines a map's card carries about its faithfulness on the probe: deletion and insertion scores
    against random orders, each followed by its paired difference to the centre prior (``versus_prior``:
    :meth:`~visattn.maps.faithful.FaithfulnessReport.versus`), with their intervals (green: better, interval
    included; red: worse; grey: not told apart)."""
    def colour(iv) -> tuple:
        return RIGHT if iv.lo > 0 else (WRONG if iv.hi < 0 else DIM)

    d, i = versus_prior
    return [(f"faithfulness, {images} probe images:", DIM),
            (f"deletion vs random {row.deletion_score}", colour(row.deletion_score)),
            (f"  vs centre prior {d}", colour(d)),
            (f"insertion vs random {row.insertion_score}", colour(row.insertion_score)),
            (f"  vs centre prior {i}", colour(i))]


def _faithfulness(writer: Any, model, images, labels, maps: List[LayerMap], step: int,
                  summary: Dict[str, List[str]], about: Dict[str, str]) -> Dict[str, Tuple[List[Line], str]]:
    """Score the maps and the centre prior on the probe, log the scalars; returns each map's card notes and
    text-tab words by map name."""
    from .faithful import faithfulness  # the name is also log_attention_maps' flag

    report = faithfulness(model, images, labels, maps=maps, **FAITHFULNESS_PROBE)
    out = {}
    for row in report.rows:
        for what, score in (("deletion", row.deletion_score), ("insertion", row.insertion_score)):
            tag = f"faithfulness/{row.name}/{what}"
            writer.add_scalar(tag, score.mean, step)
            summary["scalars"].append(tag)
        scores = f"deletion {row.deletion_score}, insertion {row.insertion_score}"
        if row.kind == "prior":
            summary["faithfulness"].append(f"{row.name} prior: {scores}")
            continue
        d, i = versus = report.versus(row.name, PRIOR)
        summary["faithfulness"].append(f"maps/{row.name}: {scores}; vs the centre prior: deletion {d}, insertion {i}")
        words = (f"{scores} (> 0: better than random); minus the centre prior's: deletion {d}, insertion {i} "
                 "(> 0: more faithful than the prior)")
        out[row.name] = (faithfulness_notes(row, report.images, versus), words)
    about["faithfulness/<map>/deletion"] = ("probe images: random-order deletion area - the map's deletion area (true "
                                            "class probability as squares are removed most attended first); > 0: "
                                            "better than random")
    about["faithfulness/<map>/insertion"] = "probe images: the map's insertion area - random-order insertion area"
    about[f"faithfulness/{PRIOR}/deletion"] = ("the same scores of the centre prior, a Gaussian on the image centre "
                                               "(sigma a quarter of the shorter side), the same for every image: a "
                                               "map below it says no more than where objects usually are")
    return out


def _localization(writer: Any, maps: List[LayerMap], boxes: torch.Tensor, tolerance: int, image_hw, step: int,
                  notes: Dict[str, Tuple[List[Line], str]], summary: Dict[str, List[str]],
                  about: Dict[str, str]) -> Dict[str, List[List[Line]]]:
    """Each map against the probe's object boxes (:mod:`visattn.maps.localize`): a line per image (hit or miss,
    energy in the box), the probe's pointing rate and mean energy on the card and as scalars."""
    from ..data.placed import box_share
    from .localize import box_scores

    gen = torch.Generator().manual_seed(0)
    chance = float(box_share(boxes.cpu().numpy(), image_hw[0], tolerance).mean())
    area = float(((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).double().mean()) / (image_hw[0] * image_hw[1])
    per_image = {}
    for lm in maps:
        if not lm.finite():
            continue
        hit, energy = box_scores(lm, boxes, tolerance, image_hw, gen)
        per_image[lm.name] = [[(f"box: {'hit' if h else 'miss'}, energy {e:.2f}", RIGHT if h else WRONG)]
                              for h, e in zip(hit.tolist(), energy.tolist())]
        for what, v in (("pointing", hit.mean()), ("energy", energy.mean())):
            writer.add_scalar(f"localization/{lm.name}/{what}", float(v), step)
            summary["scalars"].append(f"localization/{lm.name}/{what}")
        lines = [(f"box: pointing {int(hit.sum())}/{len(hit)} (chance {chance:.0%})", TEXT),
                 (f"energy in box {energy.mean():.2f} (box area {area:.2f})", TEXT)]
        card, words = notes.get(lm.name, ([], ""))
        notes[lm.name] = ([*lines, *card], words)
    about["localization/<map>/pointing"] = (f"probe: share of images whose map peaks within {tolerance} px of the "
                                            f"object's box (chance {chance:.0%}, a random point's)")
    about["localization/<map>/energy"] = f"probe: share of the map's positive mass inside the box (the box's area: {area:.2f})"
    return per_image


def _map_images(writer: Any, maps: List[LayerMap], base: torch.Tensor, image_hw, captions, step: int,
                style: Dict[str, Any], notes: Dict[str, Tuple[List[Line], str]], explained: str,
                summary: Dict[str, List[str]], about: Dict[str, str],
                image_notes: Optional[Dict[str, List[List[Line]]]] = None) -> None:
    for lm in maps:
        if not lm.finite():
            warnings.warn(f"log_attention_maps: {lm.tag} has NaN or inf values at step {step}; picture skipped",
                          RuntimeWarning)
            summary["skipped"].append(lm.name)
            continue
        card, words = notes.get(lm.name, ((), ""))
        picture = map_picture(base, lm, image_hw, captions, notes=card, image_notes=(image_notes or {}).get(lm.name),
                              **style)
        writer.add_image(lm.tag, picture, step, dataformats="HWC")
        summary["images"].append(lm.tag)
        about[lm.tag] = lm.description + (f"; explained class: {explained}" if lm.kind in GRADIENT_KINDS else "")
        if words:
            about[lm.tag] += "; on the probe: " + words


def _channels(writer: Any, records, step: int, summary: Dict[str, List[str]], about: Dict[str, str]) -> None:
    for k, r in channel_records(records):
        if not torch.isfinite(r.weights).all():
            warnings.warn(f"log_attention_maps: channel/{k} has NaN or inf gates at step {step}; histogram skipped",
                          RuntimeWarning)
            summary["skipped"].append(f"channel/{k}")
            continue
        writer.add_histogram(f"channel/{k}", r.weights.cpu(), step)
        summary["histograms"].append(f"channel/{k}")
        what = ("gains, 2 x sigmoid, 0-2 with 1 = unchanged (init='identity')" if r.value_scale == "gain"
                else "sigmoid, 0-1")
        about[f"channel/{k}"] = f"histogram of the channel gate values of {k} over the probe images ({what})"


def log_attention_maps(
    writer: Any,
    model: torch.nn.Module,
    images: torch.Tensor,
    labels: Optional[torch.Tensor],
    step: int,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    class_names: Optional[Sequence[str]] = None,
    scale: int = 2,
    colormap: str = "jet",
    alpha: float = 0.5,
    head_maps: str = "all",
    norm: str = "fixed",
    faithfulness: bool = False,
    gradient_maps: bool = True,
    boxes: Optional[torch.Tensor] = None,
    tolerance: int = 0,
) -> Dict[str, List[str]]:
    """Run one probe forward pass of ``images`` (normalised model input, ``(B, 3, H, W)``) and log its maps.

    The pass runs in eval mode with the RNG state forked (under ``torch.no_grad()``, or with one backward
    pass for ``gradient_maps``); afterwards every module's train/eval flag is what it was, and parameters,
    BN statistics and gradients are untouched.
    ``writer``: a ``SummaryWriter`` (anything with ``add_image``/``add_histogram``/``add_text``/``add_scalar``).
    ``labels``: ``(B,)`` true classes or None. ``mean``/``std``: the normalisation to undo for display.
    ``scale``: upscaling of the displayed images (32x32 at 2 -> 64 px). ``head_maps``: which class-token
    layers get one ``cls_head<i>`` image per head: ``"all"``, ``"last"`` or ``"none"``. ``norm``:
    ``"fixed"`` (each map kind on its declared scale) or ``"per_image"`` (stretched to each map's range).
    ``faithfulness``: also log the probe's deletion/insertion scores as scalars (extra forward passes) and
    write them on each map's card. ``gradient_maps``: also the ``/grad`` maps, ``rollout_grad`` and
    ``layers_grad`` for the ``labels`` classes (the predicted ones without labels). ``boxes``: ``(B, 4)`` each
    image's object box (x0, y0, x1, y1 in input pixels; ``data.source=placed``), outlined on the pictures, with
    each map's pointing hit and energy in the box under each image (``tolerance`` px) and the probe's rates on
    the card and as ``localization/<map>/`` scalars.
    Returns ``{"images", "histograms", "scalars", "texts": tags, "skipped": names, "faithfulness": lines}``,
    and ``"faithfulness_seconds": [seconds]`` when the scores were computed.
    """
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    if head_maps not in HEAD_MAPS:
        raise ValueError(f"unknown head_maps {head_maps!r}; valid: {', '.join(HEAD_MAPS)}")
    check_norm(norm)
    if images.dim() != 4:
        raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
    param = next(model.parameters(), None)
    images = images.to(param.device if param is not None else images.device)
    labels_ = labels.to(images.device) if labels is not None else None
    b, _, h, w = images.shape
    rec, logits = probe_pass(model, images, labels_, gradients=gradient_maps)
    captions = _labels(logits, labels, b, class_names, 2 * w * scale + GAP)
    base = images_to_float(images, mean, std, (h * scale, w * scale))
    summary: Dict[str, List[str]] = {"images": [], "histograms": [], "scalars": [], "texts": [], "skipped": [],
                                     "faithfulness": []}
    about: Dict[str, str] = {}
    maps = read_maps(rec.records, model, images.shape, head_maps=head_maps)
    notes: Dict[str, Tuple[List[Line], str]] = {}
    scored = [m for m in maps if m.finite() and m.kind != "head"] if faithfulness else []
    if scored:  # nothing to score (no maps, or none finite): no scores, not even the prior's
        start = time.perf_counter()
        notes = _faithfulness(writer, model, images, labels_, scored, step, summary, about)
        summary["faithfulness_seconds"] = [time.perf_counter() - start]
    style: Dict[str, Any] = {"norm": norm, "colormap": colormap, "alpha": alpha}
    image_notes = None
    if boxes is not None:
        style["boxes"] = boxes.tolist()
        image_notes = _localization(writer, [m for m in maps if m.kind != "head"], boxes, tolerance, (h, w), step,
                                    notes, summary, about)
    explained = "the true class" if labels is not None else "the predicted class"
    _map_images(writer, maps, base, (h, w), captions, step, style, notes, explained, summary, about, image_notes)
    for k, r in named_records(rec.records, "token", dims=4):
        _matrix(writer, r, k, step, captions[0] + [(f"attention of {k}", DIM)], norm, colormap, summary, about)
    _channels(writer, rec.records, step, summary, about)
    if about:
        _describe(writer, about, step)
        summary["texts"].append("maps/descriptions")
    return summary
