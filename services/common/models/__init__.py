from treeserve.models.config import FAMILIES, ModelConfig, RopeScaling
from treeserve.models.kv_cache import KVCache, TreeAttention
from treeserve.models.transformer import DecoderLM

__all__ = ["FAMILIES", "DecoderLM", "KVCache", "ModelConfig", "RopeScaling", "TreeAttention"]
