"""TorchRec's ``torchrec.distributed.sharding.sequence_sharding`` path: the context a sequence
(EmbeddingCollection) sharding carries from its input dist to its output dist."""

from recsys_core.distributed.mc_modules import KJTList, SequenceShardingContext

__all__ = ["KJTList", "SequenceShardingContext"]
