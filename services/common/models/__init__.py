from treeserve.models.config import FAMILIES, ModelConfig, RopeScaling
from treeserve.models.kv_cache import BatchAttention, KVCache, TreeAttention
from treeserve.models.transformer import DecoderLM

__all__ = ["FAMILIES", "BatchAttention", "DecoderLM", "KVCache", "ModelConfig", "RopeScaling", "TreeAttention"]
