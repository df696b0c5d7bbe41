"""Log a model's attention maps to TensorBoard from one probe forward pass.

Tags (stable across steps, so TensorBoard's step slider walks through training, on a fixed colour scale):

* ``maps/<layer>``: spatial gates, token attention (class-token row, or attention received averaged over
  queries without a class token) and pooling weights, as overlays; ``maps/<layer>/cls_head<i>``: each head's
  class-token row; ``maps/rollout``: attention rollout through the last run of token layers on one grid;
* ``maps/<layer>/grad``, ``maps/rollout_grad`` and, for a CNN with blocks at several resolutions,
  ``maps/layers_grad`` (``gradient_maps``): the gradient-weighted maps for the true class (the predicted one
  without labels), from one backward pass over the probe (:func:`~visattn.maps.record.probe_pass`);
* ``matrix/<layer>``: the first probe image's token-by-token attention (mean over heads), with axes;
* ``channel/<layer>`` (histograms): channel gate values; ``maps/descriptions`` (text tab): one line per tag;
* ``faithfulness/<map>/deletion`` and ``/insertion`` (scalars, ``faithfulness=True``): the probe's scores
  against random orders (:func:`visattn.faithfulness`), and ``faithfulness/centre/`` the centre prior's; each
  map's card then also says its scores and its paired difference to the prior (green: better, red: worse);
* ``localization/<map>/pointing`` and ``/energy`` (scalars, with object boxes): the probe against its boxes.
* ``maps/grid_probe`` (``log.grid_probe``): a fixed 2x2 grid of probe images of four classes beside each class's
  own map, titled with the share of that map in its class's cell (:class:`GridCard`, :mod:`.grid`).

Every ``maps/`` picture lays the probe images out in as many columns as fit TensorBoard's default card
(:data:`~visattn.maps.render.MAX_WIDTH`), each cell drawn over the input pixels it sees, a colour bar below
(:func:`~visattn.maps.render.map_picture`). A map with a NaN or inf is skipped with a warning.
:class:`MapSettings` holds the options; :class:`MapLogger` is a training run's logger, with the cost budget of
``log.faithfulness=auto``.

Each family of tags is one **card**, a class with ``log(probe)`` (the :class:`Card` protocol) that writes from
the one recorded :class:`Probe`: :data:`CARDS` is the list :func:`log_attention_maps` runs and ``MapLogger.cards``
the list a run iterates, so a new card is one class added to it (docs/development.md, "a new map card"). Which
records each card takes follows their kind's entry in :mod:`.kinds` (placed maps, matrices, histograms).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ..attention.tap import AttentionRecord
from .faithful import PRIOR, box_scores, faithfulness
from .kinds import kind_of, kinds_where
from .readout import HEAD_MAPS, LayerMap, named_records, read_maps
from .record import probe_pass
from .render import (
    DIM,
    GAP,
    Line,
    box_notes,
    check_norm,
    class_captions,
    faithfulness_notes,
    images_to_float,
    map_picture,
    matrix_picture,
    scale_title,
    to_unit,
)

# small settings for a probe batch: 4x4 squares removed 4 at a time, 2 random orders per image; the centre prior
# scored beside the maps (a fixed map: no backward pass, only its curves), so each card can say whether its map
# beats it
FAITHFULNESS_PROBE = {"steps": 4, "regions": 4, "draws": 2, "bootstrap_draws": 200, "sanity": False,
                      "baselines": (PRIOR,)}
FAITHFULNESS_BUDGET = 0.05  # log.faithfulness=auto keeps the scores while they cost at most this share of an epoch


@dataclass(frozen=True)
class MapSettings:
    """How :func:`log_attention_maps` draws and scores a probe batch.

    ``mean``/``std``: the normalisation to undo for display. ``class_names``: the labels' names.
    ``scale``: upscaling of the displayed images (32x32 at 2 -> 64 px). ``colormap``, ``alpha``: the overlay's.
    ``head_maps``: which class-token layers get one ``cls_head<i>`` image per head: ``"all"``, ``"last"`` or
    ``"none"``. ``norm``: ``"fixed"`` (each map kind on its declared scale) or ``"per_image"`` (stretched to each
    map's range). ``faithfulness``: also log the probe's deletion/insertion scores as scalars (extra forward
    passes) and write them on each map's card. ``gradient_maps``: also the ``/grad`` maps, ``rollout_grad`` and
    ``layers_grad`` for the labels' classes (the predicted ones without labels). ``tolerance``: the pointing
    game's, in px, when the probe has object boxes. ``grid_probe``: also ``maps/grid_probe`` (:class:`GridCard`).
    """

    mean: Optional[Sequence[float]] = None
    std: Optional[Sequence[float]] = None
    class_names: Optional[Sequence[str]] = None
    scale: int = 2
    colormap: str = "jet"
    alpha: float = 0.5
    head_maps: str = "all"
    norm: str = "fixed"
    faithfulness: bool = False
    gradient_maps: bool = True
    tolerance: int = 0
    grid_probe: bool = False

    def __post_init__(self):
        if self.scale < 1:
            raise ValueError(f"scale must be >= 1, got {self.scale}")
        if self.head_maps not in HEAD_MAPS:
            raise ValueError(f"unknown head_maps {self.head_maps!r}; valid: {', '.join(HEAD_MAPS)}")
        check_norm(self.norm)

    @classmethod
    def from_config(cls, cfg: Any, class_names: Optional[Sequence[str]] = None) -> "MapSettings":
        """A run's settings, from its :class:`~visattn.config.Config` (``log.faithfulness="auto"`` reads as on)."""
        return cls(tuple(cfg.data.mean), tuple(cfg.data.std), None if class_names is None else list(class_names),
                   scale=cfg.log.map_scale, head_maps=cfg.log.head_maps, norm=cfg.log.map_norm,
                   faithfulness=bool(cfg.log.faithfulness), gradient_maps=cfg.log.gradient_maps,
                   tolerance=cfg.data.placed.tolerance, grid_probe=bool(getattr(cfg.log, "grid_probe", False)))


@dataclass
class Probe:
    """What every card sees of one probe pass: the writer and step, the model and its input, the recorded
    records and their maps, the drawing inputs (captions, the images as float RGB, the style) and what the
    cards hand each other and the caller: ``notes`` (each map's card lines and text-tab words, from the
    faithfulness and box cards), ``image_notes`` (lines per image per map), ``about`` (tag -> one line for
    ``maps/descriptions``) and ``summary`` (what was logged and skipped)."""

    writer: Any
    step: int
    settings: MapSettings
    model: torch.nn.Module
    images: torch.Tensor
    labels: Optional[torch.Tensor]
    boxes: Optional[torch.Tensor]
    records: List[AttentionRecord]
    maps: List[LayerMap]
    captions: List[List[Line]]
    base: torch.Tensor
    image_hw: Tuple[int, int]
    style: Dict[str, Any]
    explained: str
    summary: Dict[str, List[Any]] = field(default_factory=lambda: {k: [] for k in SUMMARY_KEYS})
    about: Dict[str, str] = field(default_factory=dict)
    notes: Dict[str, Tuple[List[Line], str]] = field(default_factory=dict)
    image_notes: Optional[Dict[str, List[List[Line]]]] = None

    def skip(self, tag: str, what: str, step_words: str = "picture skipped") -> None:
        warnings.warn(f"log_attention_maps: {tag} has NaN or inf {what} at step {self.step}; {step_words}",
                      RuntimeWarning)


class Card(Protocol):
    """A TensorBoard card: one class with ``log(probe)``, which writes its tags through ``probe.writer`` and
    notes them in ``probe.summary`` and ``probe.about``. :data:`CARDS` lists them in the order they run (the
    scores first: the map cards write them on their pictures); a new card is one class added to the list
    (``MapLogger.cards``, or ``log_attention_maps(..., cards=[*CARDS, MyCard()])``). What it puts in
    ``probe.about`` goes into ``maps/descriptions`` after the last card."""

    def log(self, probe: Probe) -> None:
        ...


class FaithfulnessCard:
    """``faithfulness/<map>/deletion`` and ``/insertion`` scalars (``settings.faithfulness``): the probe's
    scores against random orders and the centre prior's (:func:`visattn.faithfulness`), and each map's lines
    about them for its picture."""

    def log(self, probe: Probe) -> None:
        maps = [m for m in probe.maps if m.finite() and kind_of(m.kind).scored] if probe.settings.faithfulness else []
        if not maps:  # nothing to score (no maps, or none finite): no scores, not even the prior's
            return
        start = time.perf_counter()
        report = faithfulness(probe.model, probe.images, probe.labels, maps=maps, **FAITHFULNESS_PROBE)
        for row in report.rows:
            for what, score in (("deletion", row.deletion_score), ("insertion", row.insertion_score)):
                tag = f"faithfulness/{row.name}/{what}"
                probe.writer.add_scalar(tag, score.mean, probe.step)
                probe.summary["scalars"].append(tag)
            scores = f"deletion {row.deletion_score}, insertion {row.insertion_score}"
            if row.name == PRIOR:
                probe.summary["faithfulness"].append(f"{row.name} prior: {scores}")
                continue
            d, i = versus = report.versus(row.name, PRIOR)
            probe.summary["faithfulness"].append(f"maps/{row.name}: {scores}; vs the centre prior: deletion {d}, "
                                                 f"insertion {i}")
            words = (f"{scores} (> 0: better than random); minus the centre prior's: deletion {d}, insertion {i} "
                     "(> 0: more faithful than the prior)")
            probe.notes[row.name] = (faithfulness_notes(row, report.images, versus), words)
        probe.about["faithfulness/<map>/deletion"] = (
            "probe images: random-order deletion area - the map's deletion area (true class probability as squares "
            "are removed most attended first); > 0: better than random")
        probe.about["faithfulness/<map>/insertion"] = ("probe images: the map's insertion area - random-order "
                                                       "insertion area")
        probe.about[f"faithfulness/{PRIOR}/deletion"] = (
            "the same scores of the centre prior, a Gaussian on the image centre (sigma a quarter of the shorter "
            "side), the same for every image: a map below it says no more than where objects usually are")
        probe.summary["faithfulness_seconds"] = [time.perf_counter() - start]


class BoxCard:
    """With object boxes: each map against them (:func:`~visattn.maps.faithful.box_scores`):
    ``localization/<map>/pointing`` and ``/energy`` scalars, the boxes outlined on the pictures, a line per
    image (hit or miss, energy in the box) and the probe's rates on the map's picture."""

    def log(self, probe: Probe) -> None:
        from ..data.placed import box_share

        if probe.boxes is None:
            return
        boxes, tolerance, (h, w) = probe.boxes, probe.settings.tolerance, probe.image_hw
        probe.style["boxes"] = boxes.tolist()
        gen = torch.Generator().manual_seed(0)
        chance = float(box_share(boxes.cpu().numpy(), h, tolerance).mean())
        area = float(((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).double().mean()) / (h * w)
        probe.image_notes = {}
        for lm in probe.maps:
            if not kind_of(lm.kind).scored or not lm.finite():
                continue
            hit, energy = box_scores(lm, boxes, tolerance, (h, w), gen)
            probe.image_notes[lm.name], lines = box_notes(hit, energy, chance, area)
            for what, v in (("pointing", hit.mean()), ("energy", energy.mean())):
                probe.writer.add_scalar(f"localization/{lm.name}/{what}", float(v), probe.step)
                probe.summary["scalars"].append(f"localization/{lm.name}/{what}")
            card, words = probe.notes.get(lm.name, ([], ""))
            probe.notes[lm.name] = ([*lines, *card], words)
        probe.about["localization/<map>/pointing"] = (f"probe: share of images whose map peaks within {tolerance} px "
                                                      f"of the object's box (chance {chance:.0%}, a random point's)")
        probe.about["localization/<map>/energy"] = ("probe: share of the map's positive mass inside the box (the "
                                                    f"box's area: {area:.2f})")


class MapCard:
    """``maps/<name>``: every map placed on the image, over the probe images, with its caption lines."""

    def log(self, probe: Probe) -> None:
        for lm in probe.maps:
            if not lm.placed:
                continue
            if not lm.finite():
                probe.skip(lm.tag, "values")
                probe.summary["skipped"].append(lm.name)
                continue
            card, words = probe.notes.get(lm.name, ((), ""))
            picture = map_picture(probe.base, lm, probe.image_hw, probe.captions, notes=card,
                                  image_notes=(probe.image_notes or {}).get(lm.name), **probe.style)
            probe.writer.add_image(lm.tag, picture, probe.step, dataformats="HWC")
            probe.summary["images"].append(lm.tag)
            probe.about[lm.tag] = lm.description + (f"; explained class: {probe.explained}"
                                                    if kind_of(lm.kind).from_gradients else "")
            if words:
                probe.about[lm.tag] += "; on the probe: " + words


class MatrixCard:
    """``matrix/<layer>``: the first probe image's attention matrix, mean over heads, with named axes: token by
    token, or channel by channel for a covariance record (the kinds with a ``matrix`` in :mod:`.kinds`)."""

    def log(self, probe: Probe) -> None:
        st = probe.settings
        for k, r in named_records(probe.records, kinds_where("matrix"), dims=4):
            kind = kind_of(r.kind)
            w = kind.matrix(r)[0]  # (rows, columns), first probe image
            tag = f"matrix/{k}"
            if not torch.isfinite(w).all():
                probe.skip(tag, "weights")
                probe.summary["skipped"].append(tag)
                continue
            unit = to_unit(w[None], "relative", int(w.shape[-1]), st.norm)[0]
            lines = probe.captions[0] + [(f"attention of {k}", DIM)]
            probe.writer.add_image(tag, matrix_picture(unit, r.num_prefix_tokens, lines, "relative", st.norm,
                                                       st.colormap, axes=kind.axes), probe.step, dataformats="HWC")
            probe.summary["images"].append(tag)
            rows, cols = (a + "s" for a in kind.axes)
            probe.about[tag] = (f"first probe image's {kind.axes[0].split()[-1]}-by-{kind.axes[1].split()[-1]} "
                                f"attention of {k}, mean over heads (rows: {rows}, columns: {cols}"
                                f"{', class token marked' if r.num_prefix_tokens else ''}); scale: "
                                f"{scale_title('relative', st.norm)}")


class HistogramCard:
    """``channel/<layer>``: histograms of the kinds without a spatial layout (channel gates)."""

    def log(self, probe: Probe) -> None:
        for k, r in named_records(probe.records, kinds_where("draws_histogram")):
            tag = f"channel/{k}"
            if not torch.isfinite(r.weights).all():
                probe.skip(tag, "gates", "histogram skipped")
                probe.summary["skipped"].append(tag)
                continue
            probe.writer.add_histogram(tag, r.weights.cpu(), probe.step)
            probe.summary["histograms"].append(tag)
            what = ("gains, 2 x sigmoid, 0-2 with 1 = unchanged (init='identity')" if r.value_scale == "gain"
                    else "sigmoid, 0-1")
            probe.about[tag] = f"histogram of the channel gate values of {k} over the probe images ({what})"


class GateCurveCard:
    """``gates/<layer>/mean`` and ``/std``: each gate's mean value over the probe and its spread, one point per
    logging epoch, so a gate that shuts its signal off shows as a falling curve (Scalars tab)."""

    def log(self, probe: Probe) -> None:
        for kind in kinds_where("gate_curve"):
            for k, r in named_records(probe.records, kind):
                if r.value_scale == "relative" or not torch.isfinite(r.weights).all():
                    continue
                w = r.weights.float()
                for what, value in (("mean", w.mean()), ("std", w.std() if w.numel() > 1 else w.new_zeros(()))):
                    probe.writer.add_scalar(f"gates/{k}/{what}", float(value), probe.step)
                    probe.summary["scalars"].append(f"gates/{k}/{what}")
                unit = "gain, 1 = unchanged (init='identity')" if r.value_scale == "gain" else "sigmoid gate, 0-1"
                probe.about[f"gates/{k}/mean"] = (f"the {kind} gate of {k}: its mean over the probe images and "
                                                  f"positions ({unit}); /std its spread")


class GridCard:
    """``maps/grid_probe`` (``settings.grid_probe``, with labels): a fixed 2x2 grid of the probe's first images
    of four distinct classes beside each class's own map, titled with the class and the share of the map in its
    cell (:mod:`.grid`: Böhle et al. 2022, arXiv 2205.10268; Rao et al. 2022, arXiv 2203.10813), so the card
    shows class evidence and not only saliency."""

    tag = "maps/grid_probe"

    def log(self, probe: Probe) -> None:
        from .grid import describe, grid_picture, grid_probe

        st = probe.settings
        if not st.grid_probe or probe.labels is None:
            return
        gp = grid_probe(probe.model, probe.images, probe.labels)
        if gp is None:  # fewer than 4 classes in the probe batch
            probe.summary["skipped"].append(self.tag)
            return
        if not gp.map.finite():
            probe.skip(self.tag, "values")
            probe.summary["skipped"].append(self.tag)
            return
        picture = grid_picture(gp, st.mean, st.std, st.class_names, st.scale, st.colormap, st.alpha)
        probe.writer.add_image(self.tag, picture, probe.step, dataformats="HWC")
        probe.summary["images"].append(self.tag)
        probe.about[self.tag] = describe(gp)


CARDS: Tuple[Card, ...] = (FaithfulnessCard(), BoxCard(), MapCard(), MatrixCard(), HistogramCard(), GateCurveCard(),
                           GridCard())
SUMMARY_KEYS = ("images", "histograms", "scalars", "texts", "skipped", "faithfulness")


def log_attention_maps(writer: Any, model: torch.nn.Module, images: torch.Tensor, labels: Optional[torch.Tensor],
                       step: int, settings: MapSettings = MapSettings(),
                       boxes: Optional[torch.Tensor] = None, cards: Sequence[Card] = CARDS) -> Dict[str, List[str]]:
    """Run one probe forward pass of ``images`` (normalised model input, ``(B, 3, H, W)``) and log its maps:
    each of ``cards`` (default :data:`CARDS`) in turn logs its part of the one :class:`Probe`.

    The pass runs in eval mode with the RNG state forked (under ``torch.no_grad()``, or with one backward
    pass for ``settings.gradient_maps``); afterwards every module's train/eval flag is what it was, and
    parameters, BN statistics and gradients are untouched.
    ``writer``: a ``SummaryWriter`` (anything with ``add_image``/``add_histogram``/``add_text``/``add_scalar``).
    ``labels``: ``(B,)`` true classes or None. ``boxes``: ``(B, 4)`` each image's object box (x0, y0, x1, y1
    in input pixels; ``data.source=placed``), outlined on the pictures, with each map's pointing hit and energy
    in the box under each image and the probe's rates on the card and as ``localization/<map>/`` scalars.
    Returns ``{"images", "histograms", "scalars", "texts": tags, "skipped": names, "faithfulness": lines}``,
    and ``"faithfulness_seconds": [seconds]`` when the scores were computed.
    """
    if images.dim() != 4:
        raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
    param = next(model.parameters(), None)
    images = images.to(param.device if param is not None else images.device)
    labels_ = labels.to(images.device) if labels is not None else None
    _, _, h, w = images.shape
    st = settings
    rec, logits = probe_pass(model, images, labels_, gradients=st.gradient_maps)
    probe = Probe(writer, step, st, model, images, labels_, boxes, list(rec.records),
                  read_maps(rec.records, model, images.shape, head_maps=st.head_maps),
                  class_captions(logits, labels, st.class_names, 2 * w * st.scale + GAP),
                  images_to_float(images, st.mean, st.std, (h * st.scale, w * st.scale)), (h, w),
                  {"norm": st.norm, "colormap": st.colormap, "alpha": st.alpha},
                  "the true class" if labels is not None else "the predicted class")
    for card in cards:
        card.log(probe)
    if probe.about:  # maps/descriptions (Text tab): one line per tag the cards wrote
        rows = "\n".join(f"| `{tag}` | {text} |" for tag, text in probe.about.items())
        writer.add_text("maps/descriptions", "| tag | what it shows |\n|---|---|\n" + rows, step)
        probe.summary["texts"].append("maps/descriptions")
    return probe.summary


class MapLogger:
    """A training run's map logging: its :class:`MapSettings` and ``log.faithfulness="auto"``'s budget.

    Under ``"auto"`` the faithfulness scores are computed at the first logging step and kept while they cost
    at most :data:`FAITHFULNESS_BUDGET` of the epoch's training time; past that ``faithfulness_on`` turns off
    for the rest of the run, with one line to ``say``. ``true``/``false`` always/never score.
    """

    def __init__(self, cfg: Any, class_names: Optional[Sequence[str]] = None, say: Callable[[str], Any] = print,
                 budget: Optional[float] = None):
        self.settings = MapSettings.from_config(cfg, class_names)
        self.auto = cfg.log.faithfulness == "auto"
        self.faithfulness_on = bool(cfg.log.faithfulness)
        self.budget = FAITHFULNESS_BUDGET if budget is None else budget
        self.say = say
        self.cards: List[Card] = list(CARDS)  # what each logging step draws, in order; append a Card to add one

    def log(self, writer: Any, model: torch.nn.Module, probe: Sequence[Any], step: int,
            epoch_seconds: Optional[float] = None) -> List[str]:
        """Log ``probe`` (images, labels[, boxes]) at ``step``; ``epoch_seconds``: the epoch's training time, for
        the budget. Returns the maps not logged because they held NaN or inf (the warnings are silenced: the
        caller reports them once)."""
        settings = replace(self.settings, faithfulness=self.faithfulness_on)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            summary = log_attention_maps(writer, model, probe[0], probe[1], step, settings,
                                         boxes=probe[2] if len(probe) > 2 else None, cards=self.cards)
        cost = summary.get("faithfulness_seconds")
        if self.auto and cost and epoch_seconds and cost[0] > self.budget * epoch_seconds:
            self.faithfulness_on = False
            self.say(f"log.faithfulness=auto: the faithfulness scores took {cost[0]:.1f} s, more than "
                     f"{self.budget:.0%} of the {epoch_seconds:.0f} s epoch; not computed again in this run "
                     "(log.faithfulness=true keeps them)")
        return list(summary.get("skipped", []))
