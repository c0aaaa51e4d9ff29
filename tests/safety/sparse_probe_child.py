"""Child process of test_sparse_memory_safety.py: every malformed sparse input x every public
entry point that hands lengths/offsets/ids to native code. One JSON line per case, printed
(and flushed) BEFORE the case runs as ``{"start": case}`` and after it as its outcome, so a
crash (a signal) names the case it died in.

Run: ``python tests/safety/sparse_probe_child.py [substring filter]``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
)
from recsys_core.inference import QuantEmbeddingBagCollection
from recsys_core.kernels.config import KernelBackend
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingCollection

T = torch.tensor
VALUES = T([1, 2, 3, 4])
HUGE = 2**62

# name -> (KJT constructor kwargs (keys a, b; batch 2; 4 values), is the input weighted)
INPUTS: dict[str, dict[str, Any]] = {
    "negative_length_totals_match": {"lengths": T([1, 1, -1, 3])},
    "negative_length": {"lengths": T([3, -1, 1, 1])},
    "negative_length_int32": {"lengths": T([1, 1, -1, 3], dtype=torch.int32)},
    "decreasing_offsets": {"offsets": T([0, 3, 1, 3, 4])},
    "offsets_not_from_zero": {"offsets": T([1, 2, 3, 4, 4])},
    "last_offset_past_values": {"offsets": T([0, 1, 2, 3, 9])},
    "lengths_past_values": {"lengths": T([1, 1, 1, 2])},
    "huge_lengths_overflow": {"lengths": T([HUGE, HUGE, HUGE, -HUGE])},
    "huge_lengths_wrap_to_zero": {"lengths": T([HUGE] * 8), "stride": 4},
    "lengths_wrong_count": {"lengths": T([1, 1, 2])},
    "stride_disagrees": {"lengths": T([1, 1, 1, 1]), "stride": 3},
    "length_per_key_lies": {"lengths": T([1, 1, -1, 3]), "length_per_key": [2, 2]},
    "length_per_key_wrong": {"lengths": T([1, 1, 1, 1]), "length_per_key": [3, 1]},
    "offset_per_key_wrong": {"lengths": T([1, 1, 1, 1]), "offset_per_key": [0, 1, 4]},
    "lengths_offsets_disagree": {"lengths": T([1, 1, 1, 1]), "offsets": T([0, 2, 2, 3, 4])},
    "vbe_strides_disagree": {"lengths": T([1, 1, 1, 1]), "stride_per_key_per_rank": [[2], [3]]},
    "weights_short": {"lengths": T([1, 1, 1, 1]), "weights": T([1.0, 2.0])},
    "weights_short_negative_length": {"lengths": T([1, 1, -1, 3]), "weights": T([1.0] * 4)},
}

BAGS = [EmbeddingBagConfig(name="t1", embedding_dim=2, num_embeddings=10, feature_names=["a"]),
        EmbeddingBagConfig(name="t2", embedding_dim=2, num_embeddings=10, feature_names=["b"])]
SEQ = [EmbeddingConfig(name="t1", embedding_dim=2, num_embeddings=10, feature_names=["a"]),
       EmbeddingConfig(name="t2", embedding_dim=2, num_embeddings=10, feature_names=["b"])]


def _weighted(kwargs: dict[str, Any]) -> bool:
    return "weights" in kwargs


def _dmp(weighted: bool) -> torch.nn.Module:
    from recsys_core.distributed import DistributedModelParallel

    return DistributedModelParallel(EmbeddingBagCollection(BAGS, is_weighted=weighted),
                                    device=torch.device("cpu"))


def _quant(weighted: bool) -> torch.nn.Module:
    return QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(BAGS, is_weighted=weighted))


def _fused(backend: KernelBackend) -> Callable[[bool], torch.nn.Module]:
    def build(weighted: bool) -> torch.nn.Module:
        return FusedEmbeddingBagCollection(BAGS, torch.optim.SGD, {"lr": 0.1},
                                           is_weighted=weighted, backend=backend)
    return build


def _touch(out: Any) -> Any:
    """Read every tensor of an op's result (a lazily wrong result must fail here, not later)."""
    if hasattr(out, "wait"):
        out = out.wait()
    if isinstance(out, KeyedJaggedTensor):
        return [out.values().sum().item(), out.lengths().sum().item()]
    if isinstance(out, dict):
        return {k: _touch(v) for k, v in out.items()}
    if isinstance(out, list | tuple):
        return [_touch(v) for v in out]
    if hasattr(out, "values"):
        return out.values().sum().item()
    return out


# name -> function of a fresh KJT (and whether it is weighted)
MODULES: dict[str, Callable[[bool], torch.nn.Module]] = {
    "EmbeddingBagCollection": lambda w: EmbeddingBagCollection(BAGS, is_weighted=w),
    "FusedEmbeddingBagCollection[fbgemm]": _fused(KernelBackend.AUTO),
    "FusedEmbeddingBagCollection[torch]": _fused(KernelBackend.TORCH),
    "EmbeddingCollection": lambda w: EmbeddingCollection(SEQ),
    "FusedEmbeddingCollection": lambda w: FusedEmbeddingCollection(SEQ, torch.optim.SGD, {"lr": 0.1}),
    "QuantEmbeddingBagCollection": _quant,
    "DistributedModelParallel(EBC)": _dmp,
}

OPS: dict[str, Callable[[KeyedJaggedTensor], Any]] = {
    "permute": lambda k: k.permute([1, 0]),
    "permute_repeat": lambda k: k.permute([1, 0, 1]),
    "split": lambda k: k.split([1, 1]),
    "to_dict": lambda k: {key: jt.to_padded_dense(3) for key, jt in k.to_dict().items()},
    "getitem": lambda k: k["b"].to_dense(),
    "index_select_batch": lambda k: k.index_select_batch([1, 0]),
    "concat": lambda k: KeyedJaggedTensor.concat([k, k.permute([0, 1])]),
    "dist_splits": lambda k: k.dist_splits([1, 1]),
    "validate": lambda k: k.validate(),
}


# JaggedTensor inputs (3 bags, 4 values) and the ops that hand them to kernels
JT_INPUTS: dict[str, dict[str, Any]] = {
    "jt_negative_length": {"lengths": T([1, -1, 4])},
    "jt_length_past_values": {"lengths": T([1, 1, 5])},
    "jt_decreasing_offsets": {"offsets": T([0, 3, 1, 4])},
    "jt_offsets_past_values": {"offsets": T([0, 1, 2, 9])},
    "jt_huge_lengths": {"lengths": T([HUGE] * 4)},
    "jt_weights_short": {"lengths": T([1, 1, 2]), "weights": T([1.0, 2.0])},
}
JT_OPS: dict[str, Callable[[JaggedTensor], Any]] = {
    "to_dense": lambda j: j.to_dense(),
    "to_padded_dense": lambda j: j.to_padded_dense(3),
    "to_dense_weights": lambda j: j.to_dense_weights() if j.weights_or_none() is not None
    else j.to_dense(),
    "to_padded_dense_weights": lambda j: j.to_padded_dense_weights(3)
    if j.weights_or_none() is not None else j.to_padded_dense(),
}
# KeyedTensor inputs (width 4) and the ops that slice or permute by length_per_key
KT_INPUTS: dict[str, dict[str, Any]] = {
    "kt_negative_width": {"length_per_key": [-1, 5]},
    "kt_widths_past_values": {"length_per_key": [2, 5]},
    "kt_offset_per_key_wrong": {"length_per_key": [2, 2], "offset_per_key": [0, 3, 4]},
}
KT_OPS: dict[str, Callable[[Callable[[], KeyedTensor]], Any]] = {
    "to_dict": lambda kt: kt().to_dict(),
    "regroup": lambda kt: KeyedTensor.regroup(
        [kt(), KeyedTensor(["c"], [1], torch.ones(3, 1))], [["b", "c"], ["a"]]),
}


def cases() -> list[tuple[str, Callable[[], Any]]]:
    out: list[tuple[str, Callable[[], Any]]] = []
    for input_name, kwargs in JT_INPUTS.items():
        for op_name, op in JT_OPS.items():
            out.append((f"{input_name}/{op_name}",
                        lambda op=op, kw=kwargs: op(JaggedTensor(values=VALUES.float(), **kw))))
    for input_name, kwargs in KT_INPUTS.items():
        def kt(kw: dict[str, Any] = kwargs) -> KeyedTensor:
            return KeyedTensor(keys=["a", "b"], values=torch.ones(3, 4), **kw)
        for op_name, op in KT_OPS.items():
            out.append((f"{input_name}/{op_name}", lambda op=op, kt=kt: op(kt)))
    for input_name, kwargs in INPUTS.items():
        def kjt(kwargs: dict[str, Any] = kwargs) -> KeyedJaggedTensor:
            return KeyedJaggedTensor(keys=["a", "b"], values=VALUES.clone(), **kwargs)
        for op_name, op in OPS.items():
            out.append((f"{input_name}/{op_name}", lambda op=op, kjt=kjt: _touch(op(kjt()))))
        for module_name, build in MODULES.items():
            def run(build: Callable = build, kjt: Callable = kjt,
                    weighted: bool = _weighted(kwargs)) -> Any:
                module = build(weighted)
                return _touch(module(kjt()))
            out.append((f"{input_name}/{module_name}", run))
    return out


def main() -> None:
    pattern = sys.argv[1] if len(sys.argv) > 1 else ""
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    torch.manual_seed(0)
    for name, run in cases():
        if pattern not in name:
            continue
        print(json.dumps({"start": name}), flush=True)
        try:
            result = run()
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            print(json.dumps({"case": name, "error": type(exc).__name__,
                              "message": str(exc)[:500]}), flush=True)
        else:
            print(json.dumps({"case": name, "result": repr(result)[:500]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
