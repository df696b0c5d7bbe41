"""visattn: vision attention blocks, CIFAR-10 training and attention-map overlays."""
__version__ = "0.1.0"

from .attention import (  # noqa: F401
    AttentionRecord,
    AttentionTap,
    attention_info,
    create_attention,
    list_attention,
    register_attention,
)
from .attention.insert import *  # noqa: F401,F403
from .models import create_model, list_models, register_model  # noqa: F401
from .maps import *  # noqa: F401,F403
from .maps import (  # noqa: F401  (issue 11: explicit exports)
    ConvGeometry,
    FaithfulnessReport,
    GridGeometry,
    LayerMap,
    add_taps,
    faithfulness,
    read_maps,
    remove_taps,
    trace_geometry,
)
