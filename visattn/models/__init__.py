"""Models by name: CIFAR ResNets with attention slots, a small ViT and a CCT-style hybrid."""
from .registry import create_model, list_models, model_options, register_model

from . import resnet, vit, cct  # noqa: F401,E402  (importing registers the models)
