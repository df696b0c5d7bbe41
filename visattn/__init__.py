"""visattn: vision attention blocks, CIFAR-10 training and attention-map overlays."""
__version__ = "0.1.0"

# The user's verbs and the one type they pass between them; everything else is importable from its submodule
# (visattn.attention, visattn.models, visattn.maps, visattn.config, visattn.trainer, visattn.rundir, ...).
from .attention import attn_layer, create_attention, insert_attention, list_attention
from .config import load_config
from .maps import LayerMap, faithfulness, overlay, read_maps, record_attention
from .models import create_model, list_models, model_options

__all__ = [
    "create_attention", "list_attention", "attn_layer", "insert_attention",  # blocks
    "create_model", "list_models", "model_options",  # models
    "record_attention", "read_maps", "LayerMap", "overlay", "faithfulness",  # attention maps
    "load_config", "train", "load_model_from_checkpoint",  # training and trained models
]


def __getattr__(name: str):  # noqa: ANN202 (PEP 562)
    """``train`` and ``load_model_from_checkpoint`` load on first use: ``visattn.evaluate`` and ``visattn.trainer``
    are also run as ``python -m`` commands, and importing them here first would make runpy warn."""
    if name == "train":
        from .trainer import run

        return run
    if name == "load_model_from_checkpoint":
        from .evaluate import load_model_from_checkpoint

        return load_model_from_checkpoint
    raise AttributeError(f"module 'visattn' has no attribute {name!r}")
