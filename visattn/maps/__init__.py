"""Attention maps: record any block, roll out token attention, overlay heatmaps on images."""
from .overlay import COLORMAPS, colorize, images_to_float, normalize_maps, overlay
from .record import AttentionRecorder, find_taps, infer_grid, record_attention, spatial_heatmap
from .rollout import attention_rollout
from .tensorboard import log_attention_maps

__all__ = [
    "AttentionRecorder",
    "COLORMAPS",
    "attention_rollout",
    "colorize",
    "find_taps",
    "images_to_float",
    "infer_grid",
    "log_attention_maps",
    "normalize_maps",
    "overlay",
    "record_attention",
    "spatial_heatmap",
]
