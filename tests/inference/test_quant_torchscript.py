"""QuantTBEBag scripts, saves, and loads where recsys_core cannot be imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recsys_core import DataType, EmbeddingBagCollection, KernelBackend, KeyedJaggedTensor
from recsys_core.inference import QuantEmbeddingBagCollection
from recsys_core.kernels import fbgemm_available

MakeKJT = Callable[..., KeyedJaggedTensor]
DTYPES = {"t_shared": DataType.INT8, "t_mean": DataType.INT4, "t_wide": DataType.FP16, "t_small": DataType.INT2}

# Runs in a fresh interpreter: isolated mode (-I), recsys_core made unimportable, fbgemm_gpu
# imported only to register its ops (or blocked too when the bag uses the torch kernel).
LOADER = textwrap.dedent("""
    import sys
    sys.modules["recsys_core"] = None
    try:
        import recsys_core
    except ImportError:
        pass
    else:
        raise SystemExit("recsys_core was importable")
    if sys.argv[2] == "fbgemm":
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    else:
        sys.modules["fbgemm_gpu"] = None
    import torch
    bag = torch.jit.load(sys.argv[1] + "/bag.pt")
    inputs = torch.load(sys.argv[1] + "/inputs.pt")
    torch.save(bag(*inputs), sys.argv[1] + "/out.pt")
""")


@pytest.mark.parametrize(
    "backend",
    [pytest.param(KernelBackend.FBGEMM, marks=pytest.mark.skipif(not fbgemm_available(), reason="needs fbgemm_gpu")),
     KernelBackend.TORCH],
    ids=["fbgemm", "torch"],
)
@pytest.mark.slow
def test_scripted_bag_loads_without_recsys_core(
    mixed_tables, make_kjt: MakeKJT, tmp_path: Path, backend: KernelBackend
) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(mixed_tables, is_weighted=True)
    quant = QuantEmbeddingBagCollection.from_float(ebc, DTYPES, backend=backend)
    kjt = make_kjt(mixed_tables, 7, seed=1, weighted=True)
    inputs = (kjt.values(), kjt.offsets(), kjt.weights())

    scripted = torch.jit.script(quant.tbe)
    expected = quant(kjt).values()
    assert torch.equal(scripted(*inputs), expected)
    torch.jit.save(scripted, str(tmp_path / "bag.pt"))
    torch.save(inputs, tmp_path / "inputs.pt")

    name = "fbgemm" if backend is KernelBackend.FBGEMM else "torch"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-I", "-c", LOADER, str(tmp_path), name],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)


def test_scripted_bag_keeps_its_errors(mixed_tables, make_kjt: MakeKJT) -> None:
    quant = QuantEmbeddingBagCollection.from_float(
        EmbeddingBagCollection(mixed_tables), DTYPES, backend=KernelBackend.TORCH
    )
    scripted = torch.jit.script(quant.tbe)
    with pytest.raises(torch.jit.Error, match="feature .f_small.: id 9 is outside"):
        scripted(torch.tensor([0, 0, 0, 0, 9]), torch.arange(6))
    with pytest.raises(torch.jit.Error, match="offsets must be 1-D"):
        scripted(torch.tensor([0]), torch.arange(3))


@pytest.mark.slow
def test_disabled_fbgemm_uses_torch_kernel(tmp_path: Path) -> None:
    """RECSYS_CORE_DISABLE_FBGEMM=1: the torch kernel is chosen, fbgemm_gpu is never imported,
    and the quantized bag still scripts."""
    code = textwrap.dedent("""
        import sys, torch
        from recsys_core import DataType, EmbeddingBagCollection, EmbeddingBagConfig, KernelBackend
        from recsys_core import KeyedJaggedTensor
        from recsys_core.inference import QuantEmbeddingBagCollection
        ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=8)])
        quant = QuantEmbeddingBagCollection.from_float(ebc, DataType.INT4)
        assert quant.kernel_backend() is KernelBackend.TORCH
        kjt = KeyedJaggedTensor(keys=["t"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
        out = torch.jit.script(quant.tbe)(kjt.values(), kjt.offsets())
        assert torch.equal(out, quant(kjt).values())
        try:
            QuantEmbeddingBagCollection.from_float(ebc, DataType.INT4, backend=KernelBackend.FBGEMM)
        except ValueError as e:
            assert "disabled by RECSYS_CORE_DISABLE_FBGEMM" in str(e), e
        else:
            raise SystemExit("FBGEMM backend was not refused")
        assert "fbgemm_gpu" not in sys.modules
    """)
    env = {**os.environ, "RECSYS_CORE_DISABLE_FBGEMM": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
