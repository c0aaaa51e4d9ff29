"""TorchRec's helpers: equality, conversion modules, size_in_bytes, imports from jagged_tensor."""

import torch

from recsys_core.sparse import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    jt_is_equal,
    kjt_is_equal,
)


def by_lengths() -> KeyedJaggedTensor:
    """a: [1], [2, 3]   b: [], [4]"""
    return KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1.0, 2.0, 3.0, 4.0]),
        lengths=torch.tensor([1, 2, 0, 1]),
    )


def by_offsets() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1.0, 2.0, 3.0, 4.0]),
        offsets=torch.tensor([0, 1, 3, 3, 4]),
    )


def test_kjt_is_equal() -> None:
    assert kjt_is_equal(by_lengths(), by_offsets())
    assert not kjt_is_equal(by_lengths(), by_lengths().permute([1, 0]))
    other_values = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1.0, 2.0, 3.0, 5.0]),
        lengths=torch.tensor([1, 2, 0, 1]),
    )
    assert not kjt_is_equal(by_lengths(), other_values)
    fewer = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1.0]), lengths=[1, 0])
    assert not kjt_is_equal(by_lengths(), fewer)
    weighted = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1.0, 2.0, 3.0, 4.0]),
        lengths=torch.tensor([1, 2, 0, 1]),
        weights=torch.ones(4),
    )
    assert not kjt_is_equal(by_lengths(), weighted)
    assert not kjt_is_equal(by_lengths(), "not a kjt")  # type: ignore[arg-type]


def test_jt_is_equal() -> None:
    a = JaggedTensor(values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([2, 0]))
    b = JaggedTensor(values=torch.tensor([1.0, 2.0]), offsets=torch.tensor([0, 2, 2]))
    c = JaggedTensor(values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 1]))
    assert jt_is_equal(a, b)
    assert not jt_is_equal(a, c)
    assert not jt_is_equal(a, by_lengths())  # type: ignore[arg-type]


def test_conversion_modules_scripted() -> None:
    to_dict = torch.jit.script(ComputeKJTToJTDict())
    back = torch.jit.script(ComputeJTDictToKJT())
    jts = to_dict(by_lengths())
    assert jts["a"].lengths().tolist() == [1, 2]
    assert jts["b"].values().tolist() == [4.0]
    kjt = back(jts)
    assert kjt.keys() == ["a", "b"]
    assert kjt.lengths().tolist() == [1, 2, 0, 1]
    assert kjt_is_equal(kjt, by_lengths())


def test_size_in_bytes() -> None:
    kjt = by_lengths()  # 4 float32 values + 4 int64 lengths
    assert kjt.size_in_bytes() == 4 * 4 + 4 * 8
    kjt.offsets()  # + 5 int64 offsets
    assert kjt.size_in_bytes() == 4 * 4 + 4 * 8 + 5 * 8
    vbe = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1.0, 2.0, 3.0]),
        lengths=torch.tensor([1, 1, 1], dtype=torch.int32),
        stride_per_key_per_rank=[[1], [2]],
    )
    assert vbe.size_in_bytes() == 3 * 4 + 3 * 4 + 2 * 4
    jt = JaggedTensor(values=torch.tensor([1, 2]), lengths=torch.tensor([2], dtype=torch.int32))
    assert jt.size_in_bytes() == 2 * 8 + 4
    kt = KeyedTensor(keys=["x"], length_per_key=[3], values=torch.zeros(2, 3, dtype=torch.float16))
    assert kt.size_in_bytes() == 6 * 2


def test_torchrec_import_path_for_every_type() -> None:
    # TorchRec code imports all of these from torchrec.sparse.jagged_tensor.
    from recsys_core.sparse.jagged_tensor import (
        ComputeJTDictToKJT as ToKJT,
    )
    from recsys_core.sparse.jagged_tensor import (
        KeyedJaggedTensor as KJT,
    )
    from recsys_core.sparse.jagged_tensor import (
        KeyedTensor as KT,
    )
    from recsys_core.sparse.jagged_tensor import (
        kjt_is_equal as is_equal,
    )

    assert KJT is KeyedJaggedTensor and KT is KeyedTensor
    assert ToKJT is ComputeJTDictToKJT and is_equal is kjt_is_equal
