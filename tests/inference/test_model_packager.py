"""``inference.model_packager`` as TorchRec documents and tests it: a PredictFactory, its configs
and extra files in a torch.package archive; the serving side finds the factory as
``__module_loader.MODULE_FACTORY`` and the factory reads its configs from the package."""

from __future__ import annotations

import io

import pytest
import torch
from packaged_factory import TinyConfig, TinyFactory
from torch.package import PackageExporter, PackageImporter

from recsys_core.inference.model_packager import (
    PredictFactoryPackager,
    load_config_text,
)


class _Packager(PredictFactoryPackager):
    @classmethod
    def set_extern_modules(cls, pe: PackageExporter) -> None:
        pe.extern(["io", "numpy", "numpy.**"])

    @classmethod
    def set_mocked_modules(cls, pe: PackageExporter) -> None:
        pe.mock(["fbgemm_gpu", "fbgemm_gpu.**"])


def _package(**extra: str | bytes) -> PackageImporter:
    buf = io.BytesIO()
    _Packager.save_predict_factory(
        predict_factory=TinyFactory,
        configs={"model_name": "sparsenn", "config.pkl": TinyConfig(width=3, value=0.5)},
        output=buf,
        extra_files=dict(extra),
    )
    buf.seek(0)
    return PackageImporter(buf)


def test_extra_files_and_configs_round_trip() -> None:
    pi = _package(dummy_text_field="test", dummy_binary_field=b"abc")
    assert pi.load_text("extra_files", "dummy_text_field") == "test"
    assert pi.load_binary("extra_files", "dummy_binary_field") == b"abc"
    assert pi.load_text("__configs", "model_name") == "sparsenn"
    assert pi.load_pickle("__configs", "config.pkl").width == 3


def test_the_packaged_factory_builds_the_model_from_its_configs() -> None:
    pi = _package()
    factory = pi.import_module("__module_loader").MODULE_FACTORY
    assert factory.__name__ == "TinyFactory"
    assert factory is not TinyFactory  # the package's own copy of the class
    module = factory().create_predict_module()
    assert module.name == "sparsenn"
    out = module(torch.tensor([[1.0, 2.0, 4.0]]))
    torch.testing.assert_close(out, torch.tensor([[3.5]]))  # 0.5 * (1 + 2 + 4)


def test_extra_file_of_another_type_is_refused_and_configs_need_a_package() -> None:
    with pytest.raises(ValueError, match=r"extra_files\['n'\] is a int; give str or bytes"):
        _Packager.save_predict_factory(TinyFactory, {}, io.BytesIO(), {"n": 3})  # type: ignore[dict-item]
    with pytest.raises(RuntimeError, match="from code inside such a package"):
        load_config_text("model_name")
