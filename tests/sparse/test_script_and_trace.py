"""The sparse types under torch.jit.script and torch.fx: outputs equal eager, by hand values.

No ``from __future__ import annotations`` here: TorchScript and fx read the real annotations
of the modules below.
"""

import pytest
import torch

from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def two_key_kjt() -> KeyedJaggedTensor:
    """f0: [1], [2, 3]   f1: [4, 5, 6], []"""
    return KeyedJaggedTensor(
        keys=["f0", "f1"],
        values=torch.tensor([1, 2, 3, 4, 5, 6]),
        lengths=torch.tensor([1, 2, 3, 0]),
    )


class ValuesTimesTwo(torch.nn.Module):
    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return kjt["f1"].values() * 2


class KeyedTensorToDict(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        kt = KeyedTensor(keys=["a", "b"], length_per_key=[2, 1], values=x)
        return kt.to_dict()


class KJTOps(torch.nn.Module):
    """Builds a KJT from tensors, permutes, splits, reads per-key views and host metadata."""

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths)
        permuted = kjt.permute([2, 0, 1])
        first, rest = permuted.split([1, 2])
        jt = rest.to_dict()["b"]
        return [
            permuted.values(),
            permuted.lengths(),
            first.values(),
            jt.offsets(),
        ]


class KJTHostMetadata(torch.nn.Module):
    """Host-side ints (a trace cannot record them; scripting can)."""

    def forward(self, kjt: KeyedJaggedTensor) -> list[int]:
        return kjt.length_per_key() + kjt.offset_per_key() + [kjt.stride()]


class KJTRoundTrip(torch.nn.Module):
    def forward(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.concat([kjt, kjt.permute([1])])


class JaggedOps(torch.nn.Module):
    def forward(self, jt: JaggedTensor) -> list[torch.Tensor]:
        padded = jt.to_padded_dense(3, -1.0)
        return [padded, jt.offsets(), jt.lengths()]


class RegroupModule(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        a = KeyedTensor.from_tensor_list(["a", "b"], [x[:, :1], x[:, 1:]])
        b = KeyedTensor(keys=["c"], length_per_key=[2], values=y)
        return KeyedTensor.regroup([a, b], [["c", "a"], ["b"]])


def _compiled(module: torch.nn.Module, compile_fn: str) -> torch.nn.Module:
    """``module`` as is ("eager"), scripted, fx-traced, or traced then scripted."""
    if compile_fn == "script":
        return torch.jit.script(module)
    if compile_fn == "trace":
        return torch.fx.symbolic_trace(module)
    if compile_fn == "trace_then_script":
        return torch.jit.script(torch.fx.symbolic_trace(module))
    assert compile_fn == "eager", compile_fn
    return module


def test_script_values_times_two() -> None:
    scripted = torch.jit.script(ValuesTimesTwo())
    assert scripted(two_key_kjt()).tolist() == [8, 10, 12]
    assert ValuesTimesTwo()(two_key_kjt()).tolist() == [8, 10, 12]


@pytest.mark.parametrize("compile_fn", ["script", "trace"])
def test_keyed_tensor_to_dict(compile_fn: str) -> None:
    compiled = _compiled(KeyedTensorToDict(), compile_fn)
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = compiled(x)
    assert list(out) == ["a", "b"]
    assert out["a"].tolist() == [[1.0, 2.0], [4.0, 5.0]]
    assert out["b"].tolist() == [[3.0], [6.0]]


def kjt_ops_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    # a: [1], [2, 3]   b: [], [4]   c: [5, 6], [7]
    return torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([1, 2, 0, 1, 2, 1])


KJT_OPS_EXPECTED = [
    [5, 6, 7, 1, 2, 3, 4],  # permuted values: c, a, b
    [2, 1, 1, 2, 0, 1],  # permuted lengths
    [5, 6, 7],  # first split part: c
    [0, 0, 1],  # offsets of b
]


@pytest.mark.parametrize("compile_fn", ["eager", "script", "trace", "trace_then_script"])
def test_kjt_ops_match_hand_values(compile_fn: str) -> None:
    module = _compiled(KJTOps(), compile_fn)
    out = module(*kjt_ops_inputs())
    assert [t.tolist() for t in out] == KJT_OPS_EXPECTED


def test_script_host_metadata() -> None:
    scripted = torch.jit.script(KJTHostMetadata())
    # length_per_key [3, 3], offset_per_key [0, 3, 6], stride 2
    assert scripted(two_key_kjt()) == [3, 3, 0, 3, 6, 2]
    assert KJTHostMetadata()(two_key_kjt()) == [3, 3, 0, 3, 6, 2]


@pytest.mark.parametrize("compile_fn", ["script", "trace"])
def test_kjt_in_and_out(compile_fn: str) -> None:
    compiled = _compiled(KJTRoundTrip(), compile_fn)
    out = compiled(two_key_kjt())
    assert out.keys() == ["f0", "f1", "f1"]
    assert out.values().tolist() == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    assert out.lengths().tolist() == [1, 2, 3, 0, 3, 0]
    assert out.stride() == 2
    eager = KJTRoundTrip()(two_key_kjt())
    assert torch.equal(eager.values(), out.values())
    assert torch.equal(eager.lengths(), out.lengths())


def test_script_jagged_tensor_padded_dense() -> None:
    jt = JaggedTensor(values=torch.tensor([1.0, 2.0, 3.0, 4.0]), lengths=torch.tensor([1, 0, 3]))
    scripted = torch.jit.script(JaggedOps())
    padded, offsets, lengths = scripted(jt)
    assert padded.tolist() == [[1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [2.0, 3.0, 4.0]]
    assert offsets.tolist() == [0, 1, 1, 4]
    assert lengths.tolist() == [1, 0, 3]
    for eager, compiled in zip(JaggedOps()(jt), scripted(jt), strict=True):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("compile_fn", ["eager", "script", "trace"])
def test_regroup_scripted_and_traced(compile_fn: str) -> None:
    module = _compiled(RegroupModule(), compile_fn)
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    y = torch.tensor([[7.0, 8.0], [9.0, 10.0]])
    first, second = module(x, y)
    assert first.tolist() == [[7.0, 8.0, 1.0], [9.0, 10.0, 4.0]]
    assert second.tolist() == [[2.0, 3.0], [5.0, 6.0]]


def test_trace_records_kjt_methods_and_construction() -> None:
    traced = torch.fx.symbolic_trace(KJTOps())
    code = traced.code
    assert "KeyedJaggedTensor(" in code
    assert ".permute(" in code
    assert ".split(" in code
