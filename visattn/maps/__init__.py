"""Attention maps: record any model's attention (:mod:`.record`), place its cells on the input (:mod:`.geometry`),
read it out into maps (:mod:`.readout`), draw them on honest scales (:mod:`.render`), measure how faithful they
are (:mod:`.faithful`) and log them to TensorBoard (:mod:`.tensorboard`)."""
from .faithful import FaithfulnessReport, faithfulness
from .geometry import ConvGeometry, GridGeometry, trace_geometry
from .readout import (
    GRADIENT_KINDS,
    LayerMap,
    attention_rollout,
    fuse_layers,
    gradient_heatmap,
    gradient_rollout,
    infer_grid,
    read_maps,
    spatial_heatmap,
)
from .record import (
    AttentionRecorder,
    GradientRecord,
    add_taps,
    find_taps,
    probe_mode,
    probe_pass,
    record_attention,
    remove_taps,
    unwrap_model,
)
from .render import COLORMAPS, colorize, images_to_float, overlay
from .tensorboard import MapLogger, MapSettings, log_attention_maps

__all__ = [
    "AttentionRecorder",
    "COLORMAPS",
    "ConvGeometry",
    "FaithfulnessReport",
    "GRADIENT_KINDS",
    "GradientRecord",
    "GridGeometry",
    "LayerMap",
    "MapLogger",
    "MapSettings",
    "add_taps",
    "attention_rollout",
    "colorize",
    "faithfulness",
    "find_taps",
    "fuse_layers",
    "gradient_heatmap",
    "gradient_rollout",
    "images_to_float",
    "infer_grid",
    "log_attention_maps",
    "overlay",
    "probe_mode",
    "probe_pass",
    "read_maps",
    "record_attention",
    "remove_taps",
    "spatial_heatmap",
    "trace_geometry",
    "unwrap_model",
]
