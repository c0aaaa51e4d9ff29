"""Table configs the tests build again and again: tables each read by the one feature named
after it (table ``a`` by feature ``fa``)::

    one_feature_tables(EmbeddingBagConfig, {"a": (11, 8), "b": (7, 4)}, mean={"b"})
    -> [EmbeddingBagConfig(name="a", num_embeddings=11, embedding_dim=8, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", num_embeddings=7, embedding_dim=4, feature_names=["fb"],
                           pooling=PoolingType.MEAN)]

Module-level and picklable by reference, so the multi-process (gloo) tests' workers may use it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TypeVar

from recsys_core import EmbeddingBagConfig, EmbeddingConfig, PoolingType

C = TypeVar("C", EmbeddingBagConfig, EmbeddingConfig)


def one_feature_tables(config: type[C], shapes: Mapping[str, tuple[int, int]], *,
                       mean: Collection[str] = ()) -> list[C]:
    """A ``config`` (EmbeddingBagConfig or EmbeddingConfig) per ``name: (rows, dim)`` of
    ``shapes``, in order: table ``name`` of ``rows`` x ``dim`` read by feature ``f<name>``
    alone; the pooled tables named in ``mean`` pool by MEAN, the others by the default, SUM."""
    return [
        config(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{name}"],
               **({"pooling": PoolingType.MEAN} if name in mean else {}))
        for name, (rows, dim) in shapes.items()
    ]
