"""Attention maps: record any model's attention, read it out into maps with an honest scale and true
placement, overlay them on images, log them to TensorBoard and measure how faithful they are."""
from .adapters import add_taps, remove_taps
from .faithful import FaithfulnessReport, faithfulness
from .geometry import ConvGeometry, GridGeometry, trace_geometry
from .overlay import COLORMAPS, colorize, images_to_float, normalize_maps, overlay
from .readout import GRADIENT_KINDS, LayerMap, fuse_layers, read_maps
from .record import (
    AttentionRecorder,
    GradientRecord,
    find_taps,
    gradient_heatmap,
    infer_grid,
    probe_mode,
    probe_pass,
    record_attention,
    spatial_heatmap,
    unwrap_model,
)
from .rollout import attention_rollout, gradient_rollout
from .tensorboard import log_attention_maps

__all__ = [
    "AttentionRecorder",
    "COLORMAPS",
    "ConvGeometry",
    "FaithfulnessReport",
    "GRADIENT_KINDS",
    "GradientRecord",
    "GridGeometry",
    "LayerMap",
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
    "normalize_maps",
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
