"""visattn: vision attention blocks, CIFAR-10 training and attention-map overlays."""
__version__ = "0.1.0"

from .attention import (
    AttentionRecord,
    AttentionTap,
    AttnLayer,
    attention_info,
    attention_options,
    attn_layer,
    create_attention,
    insert_attention,
    list_attention,
    register_attention,
)
from .maps import (
    COLORMAPS,
    AttentionRecorder,
    ConvGeometry,
    FaithfulnessReport,
    GridGeometry,
    LayerMap,
    add_taps,
    attention_rollout,
    colorize,
    faithfulness,
    find_taps,
    images_to_float,
    infer_grid,
    log_attention_maps,
    normalize_maps,
    overlay,
    read_maps,
    record_attention,
    remove_taps,
    spatial_heatmap,
    trace_geometry,
)
from .models import create_model, list_models, model_options, register_model

__all__ = [
    "COLORMAPS", "AttentionRecord", "AttentionRecorder", "AttentionTap", "AttnLayer", "ConvGeometry",
    "FaithfulnessReport", "GridGeometry", "LayerMap", "add_taps", "attention_info", "attention_options",
    "attention_rollout", "attn_layer", "colorize", "create_attention", "create_model", "faithfulness", "find_taps",
    "images_to_float", "infer_grid", "insert_attention", "list_attention", "list_models", "log_attention_maps",
    "model_options", "normalize_maps", "overlay", "read_maps", "record_attention", "register_attention",
    "register_model", "remove_taps", "spatial_heatmap", "trace_geometry",
]
