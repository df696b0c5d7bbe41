# Temporary: the block modules' imports move to visattn.registry once the block rewrite lands.
from ..registry import ATTENTION as _ATTENTION  # noqa: F401
from ..registry import attention_info, attention_options, create_attention, list_attention, register_attention  # noqa: F401
