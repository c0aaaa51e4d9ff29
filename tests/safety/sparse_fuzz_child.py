"""Child process of test_sparse_fuzz.py: hypothesis draws KeyedJaggedTensors (lengths or
offsets, negative, huge or past the values, weights of any length, ids in and out of range)
and feeds them to the KJT ops and to the EBC / fused EBC (FBGEMM and pure torch) / quantized
EBC forwards. The property: a clear ``ValueError`` exactly when the input is malformed, else
the output equals a plain-PyTorch reference computed from the module's own tables. A crash
kills this process, which the parent reports.

Run: ``python tests/safety/sparse_fuzz_child.py [max_examples]``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    KeyedJaggedTensor,
)
from recsys_core.inference import QuantEmbeddingBagCollection
from recsys_core.kernels.config import KernelBackend

ROWS, DIM = 10, 2
KEYS = ["a", "b", "c"]


@dataclass(frozen=True)
class Draw:
    keys: list[str]
    lengths: list[int]
    ids: list[int]
    weights: list[float] | None
    as_offsets: bool

    def kjt(self) -> KeyedJaggedTensor:
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        weights = None if self.weights is None else torch.tensor(self.weights)
        values = torch.tensor(self.ids, dtype=torch.int64)
        if self.as_offsets:
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            return KeyedJaggedTensor(self.keys, values, weights, offsets=offsets)
        return KeyedJaggedTensor(self.keys, values, weights, lengths=lengths)

    def layout_ok(self) -> bool:
        # values may run past the last bag (as in TorchRec); one weight per value
        covered = sum(self.lengths)
        ok = all(0 <= n <= len(self.ids) for n in self.lengths) and covered <= len(self.ids)
        return ok and (self.weights is None or len(self.weights) == len(self.ids))

    def ids_ok(self) -> bool:
        return all(0 <= i < ROWS for i in self.ids[: sum(self.lengths)])


@st.composite
def draws(draw: st.DrawFn) -> Draw:
    num_keys = draw(st.integers(1, 3))
    batch = draw(st.integers(0, 3))
    length = st.one_of(st.integers(0, 3), st.integers(-3, -1), st.sampled_from([2**31, 2**62]))
    lengths = draw(st.lists(length, min_size=num_keys * batch, max_size=num_keys * batch))
    if draw(st.booleans()):  # mostly well-formed ids count, sometimes not
        count = max(0, sum(lengths)) if sum(lengths) < 64 else draw(st.integers(0, 12))
    else:
        count = draw(st.integers(0, 12))
    ids = draw(st.lists(st.one_of(st.integers(0, ROWS - 1), st.integers(-2, ROWS + 2)),
                        min_size=count, max_size=count))
    weights = None
    if draw(st.booleans()):
        n = count if draw(st.booleans()) else draw(st.integers(0, 12))
        weights = [float(w) for w in draw(st.lists(st.integers(-2, 2), min_size=n, max_size=n))]
    return Draw(KEYS[:num_keys], lengths, ids, weights, draw(st.booleans()))


def reference(tables: dict[str, torch.Tensor], d: Draw) -> torch.Tensor:
    """Sum pooling by hand: ``[batch, DIM * keys]``."""
    batch = len(d.lengths) // len(d.keys) if d.keys else 0
    out = torch.zeros(batch, DIM * len(d.keys))
    pos = 0
    for k, key in enumerate(d.keys):
        for b in range(batch):
            n = d.lengths[k * batch + b]
            for j in range(pos, pos + n):
                w = 1.0 if d.weights is None else d.weights[j]
                out[b, k * DIM:(k + 1) * DIM] += w * tables[key][d.ids[j]]
            pos += n
    return out


def configs(keys: list[str]) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=DIM, num_embeddings=ROWS,
                               feature_names=[k]) for k in keys]


Modules = dict[str, tuple[torch.nn.Module, dict[str, torch.Tensor], float]]


def build(keys: list[str]) -> Modules:
    """For the features ``keys``: EBC, fused EBC (FBGEMM, torch), int8 EBC; each weighted or
    not, with its tables and the tolerance of its output against the float reference."""
    torch.manual_seed(0)
    modules: Modules = {}
    for weighted in (False, True):
        ebc = EmbeddingBagCollection(configs(keys), is_weighted=weighted)
        tables = {k: ebc.embedding_bags[f"t_{k}"].weight.detach().clone() for k in keys}
        modules[f"ebc/{weighted}"] = (ebc, tables, 1e-5)
        for backend in (KernelBackend.AUTO, KernelBackend.TORCH):
            fused = FusedEmbeddingBagCollection(configs(keys), torch.optim.SGD, {"lr": 0.1},
                                                is_weighted=weighted, backend=backend)
            fused_tables = {k: fused.state_dict()[f"embedding_bags.t_{k}.weight"].clone()
                            for k in keys}
            modules[f"fused_{backend.value}/{weighted}"] = (fused, fused_tables, 1e-5)
        # int8 rows: within half a quantization step per element, summed over a few ids
        modules[f"quant/{weighted}"] = (QuantEmbeddingBagCollection.from_float(ebc), tables, 0.05)
    return modules


MODULES = {n: build(KEYS[:n]) for n in range(1, len(KEYS) + 1)}


def check(d: Draw) -> None:
    layout_ok = d.layout_ok()
    try:
        kjt = d.kjt()
        parts = kjt.permute(list(range(len(d.keys)))[::-1]).to_dict()
    except ValueError:
        assert not layout_ok, f"a well-formed KJT was refused: {d}"
    else:
        assert layout_ok, f"a malformed KJT was accepted by permute/to_dict: {d}"
        stride = len(d.lengths) // len(d.keys)
        for k, key in enumerate(d.keys):
            assert parts[key].lengths().tolist() == d.lengths[k * stride:(k + 1) * stride]
    for name, (module, tables, atol) in MODULES[len(d.keys)].items():
        weighted = name.endswith("True")
        if weighted != (d.weights is not None):
            continue
        try:
            module_out = module(d.kjt())
        except ValueError:  # IdOutOfRangeError is one
            assert not (layout_ok and d.ids_ok()), f"{name} refused a well-formed input: {d}"
            continue
        assert layout_ok and d.ids_ok(), f"{name} accepted a malformed input: {d}"
        got = module_out.values().detach().float()
        torch.testing.assert_close(got, reference(tables, d), atol=atol, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def main() -> None:
    examples = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    run = settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))(given(draws())(check))
    run()
    print(f"fuzz: {examples} examples, no crash, no wrong output")


if __name__ == "__main__":
    main()
