"""A PredictFactory that reads its config from the torch.package it is loaded from (used by
test_model_packager; a module of its own, as torch.package copies its source). No
``from __future__ import annotations``: a dataclass with string annotations looks its module
up in ``sys.modules``, where a packaged module is not."""

from dataclasses import dataclass

import torch
from torch import nn

from recsys_core.inference.model_packager import load_config_text, load_pickle_config
from recsys_core.inference.modules import BatchingMetadata, PredictFactory


@dataclass
class TinyConfig:
    width: int
    value: float


class TinyFactory(PredictFactory):
    def create_predict_module(self) -> nn.Module:
        config = load_pickle_config("config.pkl", TinyConfig)
        layer = nn.Linear(config.width, 1, bias=False)
        with torch.no_grad():
            layer.weight.fill_(config.value)
        layer.name = load_config_text("model_name")  # type: ignore[assignment]
        return layer

    def batching_metadata(self) -> dict[str, BatchingMetadata]:
        return {}

    def result_metadata(self) -> str:
        return "dict_of_tensor"

    def run_weights_independent_tranformations(self, predict_module: nn.Module) -> nn.Module:
        return predict_module

    def run_weights_dependent_transformations(self, predict_module: nn.Module) -> nn.Module:
        return predict_module
