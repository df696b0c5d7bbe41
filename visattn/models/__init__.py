"""Models by name: CIFAR ResNets with attention slots, a small ViT and a CCT-style hybrid."""
from ..registry import create_model, list_models, model_defaults, model_options, register_model
from . import cct, resnet, vit  # noqa: E402  (importing registers the models)

__all__ = ["cct", "create_model", "list_models", "model_defaults", "model_options", "register_model", "resnet", "vit"]
