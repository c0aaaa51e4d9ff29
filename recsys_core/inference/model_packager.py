"""TorchRec's ``torchrec.inference.model_packager``: a ``PredictFactory`` class and its configs
in a ``torch.package`` archive, for a serving process that builds the model from them.

    class MyPackager(PredictFactoryPackager):
        @classmethod
        def set_extern_modules(cls, pe): pe.extern(["io", "numpy.**"])
        @classmethod
        def set_mocked_modules(cls, pe): pe.mock(["fbgemm_gpu"])

    MyPackager.save_predict_factory(MyFactory, {"config.pkl": config}, "model.pt", {})
    # serving side:
    pi = torch.package.PackageImporter("model.pt")
    factory = pi.import_module("__module_loader").MODULE_FACTORY

The archive holds: ``__module_loader`` (source naming the factory class as ``MODULE_FACTORY``),
each config under ``__configs`` (text for a string, a pickle otherwise), ``extra_files``, and
the factory's module with what it imports. One difference from TorchRec: this library itself
(``recsys_core.**``, but for this module) is externed, not copied in (its kernels include C extension modules,
which ``torch.package`` cannot hold): the serving process imports the installed
``recsys_core``. For exported, self-contained serving programs see
``dlrm_app``'s ``.pt2`` export (docs/serving.md).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch
from torch.package import PackageExporter

from recsys_core.inference.modules import PredictFactory

LOADER_MODULE = "__module_loader"
LOADER_FACTORY = "MODULE_FACTORY"
LOADER_CODE = f"""
import %PACKAGE%

{LOADER_FACTORY}=%PACKAGE%.%CLASS%
"""
CONFIG_MODULE = "__configs"

T = TypeVar("T")


try:  # torch.package hands its importer to the code it loads (this module is packaged too)
    import torch_package_importer  # type: ignore[import-not-found]
except ImportError:
    torch_package_importer = None


def _package_importer() -> Any:
    """The importer of the package this module was loaded from."""
    if torch_package_importer is None:
        raise RuntimeError(
            "load_config_text / load_pickle_config read the configs of the torch.package "
            "this code was loaded from; call them from code inside such a package"
        )
    return torch_package_importer


def load_config_text(name: str) -> str:
    """A text config saved by :meth:`PredictFactoryPackager.save_predict_factory`."""
    return _package_importer().load_text(CONFIG_MODULE, name)


def load_pickle_config(name: str, clazz: type[T]) -> T:
    """A pickled config saved by :meth:`PredictFactoryPackager.save_predict_factory`, checked
    to be a ``clazz``."""
    loaded = _package_importer().load_pickle(CONFIG_MODULE, name)
    if not isinstance(loaded, clazz):
        raise TypeError(f"config {name!r} is a {type(loaded).__name__}, not a {clazz.__name__}")
    return loaded


class PredictFactoryPackager(abc.ABC):
    """Subclasses say which modules the package refers to (extern) or fakes (mock)."""

    @classmethod
    @abc.abstractmethod
    def set_extern_modules(cls, pe: PackageExporter) -> None:
        """``pe.extern([...])``: modules the serving process imports itself."""

    @classmethod
    @abc.abstractmethod
    def set_mocked_modules(cls, pe: PackageExporter) -> None:
        """``pe.mock([...])``: modules replaced by stubs in the package."""

    @classmethod
    def save_predict_factory(
        cls,
        predict_factory: type[PredictFactory],
        configs: dict[str, Any],
        output: str | Path | BinaryIO,
        extra_files: dict[str, str | bytes],
        loader_code: str = LOADER_CODE,
        package_importer: Any = torch.package.sys_importer,
    ) -> None:
        """Write ``predict_factory``, its ``configs`` and ``extra_files`` (text or bytes, under
        ``extra_files``) to ``output``."""
        with PackageExporter(output, importer=package_importer) as pe:
            cls.set_extern_modules(pe)
            cls.set_mocked_modules(pe)
            # this module goes in (its configs readers need the package's importer); the rest
            # of the library stays outside
            pe.intern(__name__)
            pe.extern(["sys", "recsys_core", "recsys_core.**"])
            pe.intern("**")
            for name, value in extra_files.items():
                if isinstance(value, str):
                    pe.save_text("extra_files", name, value)
                elif isinstance(value, bytes):
                    pe.save_binary("extra_files", name, value)
                else:
                    raise ValueError(
                        f"extra_files[{name!r}] is a {type(value).__name__}; give str or bytes"
                    )
            cls._save_predict_factory(pe, predict_factory, configs, loader_code=loader_code)

    @classmethod
    def _save_predict_factory(
        cls,
        pe: PackageExporter,
        predict_factory: type[PredictFactory],
        configs: dict[str, Any],
        loader_code: str = LOADER_CODE,
    ) -> None:
        package_name = predict_factory.__module__
        if package_name.startswith("<torch_package_"):  # re-packaging a packaged factory
            package_name = ".".join(package_name.split(".")[1:])
        code = loader_code.replace("%PACKAGE%", package_name).replace(
            "%CLASS%", predict_factory.__name__)
        pe.save_source_string(module_name=LOADER_MODULE, src=code)
        for name, config in configs.items():
            if isinstance(config, str):
                pe.save_text(CONFIG_MODULE, name, config)
            else:
                pe.save_pickle(CONFIG_MODULE, name, config)
        pe.save_module(predict_factory.__module__)


__all__ = [
    "CONFIG_MODULE",
    "LOADER_CODE",
    "LOADER_FACTORY",
    "LOADER_MODULE",
    "PredictFactoryPackager",
    "load_config_text",
    "load_pickle_config",
]
