"""Typed configuration of the table-batched embedding kernels.

Users may hand TorchRec's ``fused_params`` dict (``{"optimizer": EmbOptimType..., "learning_rate":
0.02, "eps": 0.002}``) at the boundary; :meth:`FusedOptimizerConfig.from_fused_params` turns it into
a frozen dataclass and rejects unknown keys. Inside the library only the dataclass travels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum, unique
from typing import Any

from recsys_core.types import enum_member


@unique
class EmbOptimType(Enum):
    """Optimizers fused into the embedding backward.

    Values equal FBGEMM's ``EmbOptimType`` values, so FBGEMM's enum members are accepted too.
    ``SGD`` is an alias of ``EXACT_SGD`` (FBGEMM deprecated the non-exact one; their results are
    equal because SGD is linear in the gradient).
    """

    EXACT_SGD = "exact_sgd"
    SGD = "sgd"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    ADAM = "adam"
    PARTIAL_ROWWISE_ADAM = "partial_row_wise_adam"
    LAMB = "lamb"
    PARTIAL_ROWWISE_LAMB = "partial_row_wise_lamb"

    @classmethod
    def coerce(cls, value: Any) -> EmbOptimType:
        """Accept our enum, FBGEMM's enum (same values) or its string value."""
        member = enum_member(cls, value)
        if member is None:
            valid = ", ".join(m.name for m in cls)
            raise ValueError(
                f"optimizer {value!r} is not supported by the fused embedding kernels; "
                f"use one of: {valid}"
            )
        return member

    @property
    def canonical(self) -> EmbOptimType:
        return EmbOptimType.EXACT_SGD if self is EmbOptimType.SGD else self

    @property
    def state_names(self) -> tuple[str, ...]:
        """Optimizer state tensors kept per table (``momentum1`` per element or per row...)."""
        return {
            EmbOptimType.EXACT_SGD: (),
            EmbOptimType.EXACT_ADAGRAD: ("momentum1",),
            EmbOptimType.EXACT_ROWWISE_ADAGRAD: ("momentum1",),
            EmbOptimType.ADAM: ("momentum1", "exp_avg_sq"),
            EmbOptimType.PARTIAL_ROWWISE_ADAM: ("momentum1", "exp_avg_sq"),
            EmbOptimType.LAMB: ("momentum1", "exp_avg_sq"),
            EmbOptimType.PARTIAL_ROWWISE_LAMB: ("momentum1", "exp_avg_sq"),
        }[self.canonical]

    def state_is_rowwise(self, name: str) -> bool:
        """True when state ``name`` holds one value per row (not one per element)."""
        canonical = self.canonical
        if canonical is EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            return True
        if canonical in (EmbOptimType.PARTIAL_ROWWISE_ADAM, EmbOptimType.PARTIAL_ROWWISE_LAMB):
            return name == "exp_avg_sq"
        return False


@unique
class WeightDecayMode(Enum):
    """How ``weight_decay`` enters the update (values match FBGEMM's)."""

    NONE = 0
    L2 = 1
    DECOUPLED = 2


@unique
class KernelBackend(Enum):
    """Which implementation runs the table-batched lookups."""

    AUTO = "auto"  # FBGEMM when it supports the device and optimizer, else torch
    FBGEMM = "fbgemm"
    TORCH = "torch"


TABLE_FUSED_PARAMS: tuple[str, ...] = ("cache_load_factor",)
"""Keys of TorchRec's ``fused_params`` that set up tables, not their optimizer:
``cache_load_factor`` is the cache size (a fraction of the rows) of the FUSED_UVM_CACHING
tables whose plan gives none (the planner's estimates use it too)."""


def check_table_fused_params(fused_params: Mapping[str, Any]) -> None:
    """Refuse a table key of ``fused_params`` with a value no kernel can take."""
    clf = fused_params.get("cache_load_factor")
    if clf is not None and not (isinstance(clf, (int, float)) and 0.0 < clf <= 1.0):
        raise ValueError(
            f"fused_params: cache_load_factor {clf!r} must be a fraction of the rows in (0, 1]"
        )


@dataclass(frozen=True, kw_only=True)
class FusedOptimizerConfig:
    """Optimizer applied inside the embedding backward.

    Attributes:
        optimizer: which update rule.
        learning_rate: step size.
        eps: denominator term of Adagrad / Adam / LAMB.
        beta1: first-moment decay (Adam, LAMB).
        beta2: second-moment decay (Adam, LAMB).
        weight_decay: decay coefficient (0 disables it).
        weight_decay_mode: how decay is applied. EXACT_ROWWISE_ADAGRAD honours L2 and DECOUPLED;
            ADAM / LAMB families always apply it decoupled (their FBGEMM definition); SGD and
            EXACT_ADAGRAD take no weight decay.
    """

    optimizer: EmbOptimType = EmbOptimType.EXACT_SGD
    learning_rate: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    weight_decay_mode: WeightDecayMode = WeightDecayMode.NONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", EmbOptimType.coerce(self.optimizer))
        if isinstance(self.weight_decay_mode, int):
            object.__setattr__(self, "weight_decay_mode", WeightDecayMode(self.weight_decay_mode))
        elif not isinstance(self.weight_decay_mode, WeightDecayMode):
            raw = getattr(self.weight_decay_mode, "value", self.weight_decay_mode)
            object.__setattr__(self, "weight_decay_mode", WeightDecayMode(raw))
        if not self.learning_rate >= 0:
            raise ValueError(f"fused optimizer: learning_rate must be >= 0, got {self.learning_rate}")
        if not self.eps > 0:
            raise ValueError(f"fused optimizer: eps must be > 0, got {self.eps}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"fused optimizer: {name} must be in [0, 1), got {value}")
        if self.weight_decay < 0:
            raise ValueError(f"fused optimizer: weight_decay must be >= 0, got {self.weight_decay}")
        opt = self.optimizer.canonical
        if self.weight_decay > 0 and opt in (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD):
            raise ValueError(
                f"fused optimizer: {opt.name} takes no weight_decay (FBGEMM ignores it); "
                "use EXACT_ROWWISE_ADAGRAD or ADAM for decay, or set weight_decay=0"
            )
        if (
            opt is EmbOptimType.EXACT_ROWWISE_ADAGRAD
            and self.weight_decay > 0
            and self.weight_decay_mode is WeightDecayMode.NONE
        ):
            raise ValueError(
                "fused optimizer: weight_decay > 0 with weight_decay_mode NONE does nothing; "
                "choose WeightDecayMode.L2 or WeightDecayMode.DECOUPLED"
            )

    @classmethod
    def from_fused_params(cls, fused_params: Mapping[str, Any] | None) -> FusedOptimizerConfig:
        """Parse TorchRec-style ``fused_params``; unknown keys are an error, not ignored."""
        if fused_params is None:
            return cls()
        if isinstance(fused_params, FusedOptimizerConfig):
            return fused_params
        known = {f.name for f in fields(cls)}
        table_keys = {k: fused_params[k] for k in TABLE_FUSED_PARAMS if k in fused_params}
        check_table_fused_params(table_keys)
        fused_params = {k: v for k, v in fused_params.items() if k not in TABLE_FUSED_PARAMS}
        unknown = sorted(set(fused_params) - known)
        if unknown:
            raise ValueError(
                f"fused_params has unknown key(s) {unknown}; accepted keys: {sorted(known)}"
            )
        return cls(**dict(fused_params))

    @classmethod
    def from_torch_optimizer(
        cls, optimizer_class: type, optimizer_kwargs: Mapping[str, Any]
    ) -> FusedOptimizerConfig:
        """Map ``apply_optimizer_in_backward(torch.optim.X, params, kwargs)`` to a fused rule.

        Supported: ``torch.optim.SGD`` (no momentum), ``torch.optim.Adagrad``,
        ``torch.optim.Adam`` and ``recsys_core.optim.RowWiseAdagrad``.
        """
        kwargs = dict(optimizer_kwargs)
        name = getattr(optimizer_class, "__name__", str(optimizer_class))

        def take(key: str, default: Any) -> Any:
            return kwargs.pop(key, default)

        lr = take("lr", 0.01 if name != "Adam" else 0.001)
        if name == "SGD":
            if take("momentum", 0.0) or take("nesterov", False):
                raise ValueError(
                    "apply_optimizer_in_backward: torch.optim.SGD with momentum has no fused "
                    "kernel; drop momentum or use EXACT_ROWWISE_ADAGRAD / ADAM"
                )
            wd = take("weight_decay", 0.0)
            config = cls(optimizer=EmbOptimType.EXACT_SGD, learning_rate=lr, weight_decay=wd)
        elif name == "Adagrad":
            if take("lr_decay", 0.0) or take("initial_accumulator_value", 0.0):
                raise ValueError(
                    "apply_optimizer_in_backward: Adagrad lr_decay / initial_accumulator_value "
                    "have no fused kernel; leave them at 0"
                )
            wd = take("weight_decay", 0.0)
            config = cls(
                optimizer=EmbOptimType.EXACT_ADAGRAD,
                learning_rate=lr,
                eps=take("eps", 1e-8),  # the fused kernel's default, as TorchRec (torch: 1e-10)
                weight_decay=wd,
            )
        elif name == "RowWiseAdagrad":
            wd = take("weight_decay", 0.0)
            config = cls(
                optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                learning_rate=lr,
                eps=take("eps", 1e-8),
                weight_decay=wd,
                weight_decay_mode=WeightDecayMode.L2 if wd else WeightDecayMode.NONE,
            )
        elif name in ("Adam", "AdamW"):
            if take("amsgrad", False):
                raise ValueError("apply_optimizer_in_backward: Adam amsgrad has no fused kernel")
            beta1, beta2 = take("betas", (0.9, 0.999))
            config = cls(
                optimizer=EmbOptimType.ADAM,
                learning_rate=lr,
                eps=take("eps", 1e-8),
                beta1=beta1,
                beta2=beta2,
                weight_decay=take("weight_decay", 0.0 if name == "Adam" else 0.01),
            )
        else:
            raise ValueError(
                f"apply_optimizer_in_backward: {name} has no fused embedding kernel; use "
                "torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam or "
                "recsys_core.optim.RowWiseAdagrad"
            )
        for ignorable in ("foreach", "maximize", "capturable", "differentiable", "fused"):
            if kwargs.pop(ignorable, None):
                raise ValueError(f"apply_optimizer_in_backward: {name}({ignorable}=True) is not "
                                 "supported for fused embeddings")
        if kwargs:
            raise ValueError(
                f"apply_optimizer_in_backward: {name} argument(s) {sorted(kwargs)} are not "
                "supported for fused embeddings"
            )
        return config

    @staticmethod
    def fields_given(optimizer_class: type, optimizer_kwargs: Mapping[str, Any]) -> list[str]:
        """The fields that ``from_torch_optimizer(optimizer_class, optimizer_kwargs)`` takes from
        arguments given (or from the class itself: AdamW's decay), not from defaults."""
        names = {"lr": ["learning_rate"], "eps": ["eps"], "betas": ["beta1", "beta2"],
                 "weight_decay": ["weight_decay", "weight_decay_mode"]}
        given = [f for key in optimizer_kwargs for f in names.get(key, [])]
        if getattr(optimizer_class, "__name__", "") == "AdamW" and "weight_decay" not in given:
            given.append("weight_decay")
        return given
