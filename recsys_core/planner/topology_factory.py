"""TorchRec's configs for building a :class:`Topology` from three sources, and the factory that
resolves them (``TopologyFactory.create_topology``).

Precedence, highest first: :class:`TrainerConfig` (what the user set; in a dry run its
``dry_run_*`` capacities), :class:`HardwareConfig` (what was detected), TorchRec's constants.
:class:`KernelConfig` sets the compute device, the perf multipliers and where bandwidths come
from (TorchRec's constants unless ``use_hardware_based_bandwidth`` or a
``generalized_comms_bandwidths`` model is given).
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from typing import Any

from recsys_core.planner.comms import GeneralizedCommsBandwidth
from recsys_core.planner.constants import (
    BWD_COMPUTE_MULTIPLIER,
    WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER,
)
from recsys_core.planner.topology import TORCHREC_BANDWIDTHS, Topology


def _torchrec_logger(destination: str) -> logging.Logger:
    # The loggers of recsys_core.distributed.logger (TorchRec's names and set-up), without
    # importing the runtime: the same logging.Logger objects by name.
    logger = logging.getLogger(f"{destination}-NullHandler")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


_STATIC_LOGGER = _torchrec_logger("SingleRankStaticLogger")
_ONE_TIME_LOGGER = _torchrec_logger("Cap1Logger")

CAP_OVERRIDE_THRESHOLD = 0.05
"""A TrainerConfig capacity further than this fraction from the detected one is logged."""


class TopologyConfigBase(abc.ABC):
    """A topology config: ``validate()`` and an ``additional_params`` dict for extra data (e.g.
    ``{"custom_topology_data": CustomTopologyData(...)}``)."""

    additional_params: dict[str, Any]

    def get_param(self, key: str, default: Any = None) -> Any:
        return self.additional_params.get(key, default)

    def has_param(self, key: str) -> bool:
        return key in self.additional_params

    @abc.abstractmethod
    def validate(self) -> None: ...


@dataclass(frozen=True)
class HardwareConfig(TopologyConfigBase):
    """What was detected on the machine: capacities in bytes per rank, bandwidths in bytes/ms
    (None: not detected)."""

    hbm_cap_bytes: int | None = None
    ddr_cap_bytes: int | None = None
    ssd_cap_bytes: int | None = None
    intra_host_bw: float | None = None
    inter_host_bw: float | None = None
    hbm_mem_bw: float | None = None
    ddr_mem_bw: float | None = None
    hbm_to_ddr_mem_bw: float | None = None
    ssd_mem_bw: float | None = None
    additional_params: dict[str, Any] = field(default_factory=dict)

    def get_validation_issues(self, compute_device: str | None = None) -> list[str]:
        """Values that cannot be right (a failed detection), as sentences; logs nothing.

        HBM is checked on "cuda" and "mtia" only (0 HBM is normal elsewhere); SSD may be 0."""
        issues = []
        if self.hbm_cap_bytes is not None and compute_device in ("cuda", "mtia") \
                and self.hbm_cap_bytes <= 0:
            issues.append(f"hbm_cap_bytes={self.hbm_cap_bytes} is non-positive")
        if self.ddr_cap_bytes is not None and self.ddr_cap_bytes <= 0:
            issues.append(f"ddr_cap_bytes={self.ddr_cap_bytes} is non-positive")
        if self.ssd_cap_bytes is not None and self.ssd_cap_bytes < 0:
            issues.append(f"ssd_cap_bytes={self.ssd_cap_bytes} is negative")
        for name in ("intra_host_bw", "inter_host_bw", "hbm_mem_bw", "ddr_mem_bw",
                     "hbm_to_ddr_mem_bw", "ssd_mem_bw"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                issues.append(f"{name}={value} is non-positive")
        if self.intra_host_bw is not None and self.inter_host_bw is not None \
                and self.intra_host_bw < self.inter_host_bw:
            issues.append(
                f"intra_host_bw ({self.intra_host_bw:.0f}) < inter_host_bw "
                f"({self.inter_host_bw:.0f}); intra-node bandwidth is typically much higher "
                "than inter-node"
            )
        return issues

    def validate(self, compute_device: str | None = None) -> None:
        """Logs one warning listing :meth:`get_validation_issues` (never raises: a detected
        value may be overridden by the TrainerConfig)."""
        issues = self.get_validation_issues(compute_device)
        if issues:
            _STATIC_LOGGER.warning("HardwareConfig validation: " + "; ".join(issues))


@dataclass(frozen=True)
class TrainerConfig(TopologyConfigBase):
    """What the user set: world size (required), ranks per host, capacity overrides (bytes per
    rank), dry-run capacities, pod size."""

    world_size: int | None = None
    local_world_size: int | None = None
    hbm_cap_bytes: int | None = None
    ddr_cap_bytes: int | None = None
    ssd_cap_bytes: int | None = None
    is_dry_run: bool = False
    dry_run_hbm_bytes: int | None = None
    dry_run_ddr_bytes: int | None = None
    pod_size: int | None = None
    additional_params: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.world_size is None:
            raise ValueError("world_size must be provided in TrainerConfig")
        if self.pod_size is not None and self.pod_size > self.world_size:
            raise ValueError(
                f"pod_size ({self.pod_size}) cannot be greater than world_size "
                f"({self.world_size})"
            )


@dataclass(frozen=True)
class KernelConfig(TopologyConfigBase):
    """The compute device, TorchRec's perf multipliers, and where bandwidths come from."""

    compute_device: str = "cuda"
    bwd_compute_multiplier: float = BWD_COMPUTE_MULTIPLIER
    weighted_feature_bwd_compute_multiplier: float = WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER
    uneven_sharding_perf_multiplier: float = 1.0
    use_hardware_based_bandwidth: bool = False
    """True: bandwidths from the HardwareConfig (TorchRec's constants where it has none)."""
    generalized_comms_bandwidths: GeneralizedCommsBandwidth | None = None
    """A collective bandwidth model; overrides every intra/inter-host figure."""
    additional_params: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        valid = {"cuda", "mtia", "cpu"}
        if self.compute_device not in valid:
            raise ValueError(
                f"compute_device must be one of {valid}, got '{self.compute_device}'"
            )


class TopologyFactory:
    """Builds a :class:`Topology` from the three configs (see the module docstring)."""

    @staticmethod
    def create_topology(
        trainer_config: TrainerConfig,
        hardware_config: HardwareConfig | None = None,
        kernel_config: KernelConfig | None = None,
    ) -> Topology:
        try:
            hardware = hardware_config or HardwareConfig()
            kernel = kernel_config or KernelConfig()
            trainer_config.validate()
            hardware.validate(compute_device=kernel.compute_device)
            kernel.validate()
            kwargs: dict[str, Any] = {
                "world_size": trainer_config.world_size,
                "compute_device": kernel.compute_device,
                "bwd_compute_multiplier": kernel.bwd_compute_multiplier,
                "weighted_feature_bwd_compute_multiplier":
                    kernel.weighted_feature_bwd_compute_multiplier,
                "uneven_sharding_perf_multiplier": kernel.uneven_sharding_perf_multiplier,
            }
            _trainer_params(kwargs, trainer_config, hardware)
            _memory_bandwidths(kwargs, hardware, kernel)
            _comms_bandwidths(kwargs, hardware, kernel)
            return Topology(**kwargs, created_by_factory=True)
        except Exception as error:
            _ONE_TIME_LOGGER.error(f"TopologyFactory.create_topology failed: {error}")
            raise


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _trainer_params(kwargs: dict[str, Any], trainer: TrainerConfig,
                    hardware: HardwareConfig) -> None:
    if trainer.local_world_size is not None:
        kwargs["local_world_size"] = trainer.local_world_size
    if trainer.pod_size is not None:
        kwargs["pod_size"] = trainer.pod_size
    hbm = _first(trainer.hbm_cap_bytes, hardware.hbm_cap_bytes)
    ddr = _first(trainer.ddr_cap_bytes, hardware.ddr_cap_bytes)
    ssd = _first(trainer.ssd_cap_bytes, hardware.ssd_cap_bytes)
    if trainer.is_dry_run:
        hbm = _first(trainer.dry_run_hbm_bytes, hbm)
        ddr = _first(trainer.dry_run_ddr_bytes, ddr)
    else:
        _warn_if_cap_override("hbm_cap", trainer.hbm_cap_bytes, hardware.hbm_cap_bytes,
                              "This may indicate a static model config overriding detected "
                              "hardware.")
        _warn_if_cap_override("ddr_cap", trainer.ddr_cap_bytes, hardware.ddr_cap_bytes)
    for name, value in (("hbm_cap", hbm), ("ddr_cap", ddr), ("ssd_cap", ssd)):
        if value is not None:
            kwargs[name] = value
    custom = trainer.get_param("custom_topology_data")
    if custom is not None:
        kwargs["custom_topology_data"] = custom


def _warn_if_cap_override(name: str, trainer_value: int | None, hardware_value: int | None,
                          hint: str = "") -> None:
    if trainer_value is None or hardware_value is None or hardware_value <= 0:
        return
    ratio = abs(trainer_value - hardware_value) / hardware_value
    if ratio > CAP_OVERRIDE_THRESHOLD:
        message = (f"TopologyFactory: TrainerConfig {name} ({trainer_value / 1024**3:.1f} GiB) "
                   f"differs from HardwareConfig {name} ({hardware_value / 1024**3:.1f} GiB) "
                   f"by {ratio:.0%}. Using TrainerConfig value.")
        _STATIC_LOGGER.warning(f"{message} {hint}" if hint else message)


def _memory_bandwidths(kwargs: dict[str, Any], hardware: HardwareConfig,
                       kernel: KernelConfig) -> None:
    use = kernel.use_hardware_based_bandwidth
    for name in ("hbm_mem_bw", "ddr_mem_bw", "ssd_mem_bw", "hbm_to_ddr_mem_bw"):
        detected = getattr(hardware, name) if use else None
        kwargs[name] = TORCHREC_BANDWIDTHS[name] if detected is None else detected


def _comms_bandwidths(kwargs: dict[str, Any], hardware: HardwareConfig,
                      kernel: KernelConfig) -> None:
    if kernel.generalized_comms_bandwidths is not None:
        kwargs["generalized_comms_bandwidths"] = kernel.generalized_comms_bandwidths
        return
    use = kernel.use_hardware_based_bandwidth
    intra = hardware.intra_host_bw if use else None
    inter = hardware.inter_host_bw if use else None
    kwargs["intra_host_bw"] = TORCHREC_BANDWIDTHS["intra_host_bw"] if intra is None else intra
    kwargs["inter_host_bw"] = TORCHREC_BANDWIDTHS["inter_host_bw"] if inter is None else inter
