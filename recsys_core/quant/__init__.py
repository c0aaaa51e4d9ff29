"""TorchRec's ``torchrec.quant``: quantized embedding modules for inference."""

from recsys_core.quant.embedding_modules import EmbeddingBagCollection

__all__ = ["EmbeddingBagCollection"]
