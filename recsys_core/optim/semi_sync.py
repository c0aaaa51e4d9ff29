"""Semi-synchronous training (TorchRec's ``torchrec.optim.semi_sync``).

``SemisyncOptimizer(global_params, optimizer, global_optimizer, num_local_steps)`` steps the local
optimizer every time and, every ``num_local_steps`` steps, the global one (e.g. DiLoCo's outer
optimizer) through ``global_optimizer._optimizer.global_step(local_step_counter, closure)``.
Its state is both optimizers' state in one keyed view::

    state[param] = {"semi_sync_local_<key>": ..., "semi_sync_global_<key>": ...,
                    "__semisync_global_step_counter__": tensor, "__semisync_local_step_counter__": tensor}

(the counters sit in every global parameter's state, and also appear in ``params``).
``load_state_dict`` copies tensors in place, then ``post_load_state_dict`` restores the counters
and hands each optimizer its un-prefixed state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from recsys_core.optim._state import (
    init_optimizer_attributes,
    inner_scratch_buffers,
    set_inner_optimizer_step,
    update_inner_hyper_parameters,
)
from recsys_core.optim.keyed import KeyedOptimizer

logger: logging.Logger = logging.getLogger(__name__)

SEMI_SYNC_GLOBAL_OPTIM_KEY: str = "semi_sync_global_optim"
SEMI_SYNC_LOCAL_OPTIM_KEY: str = "semi_sync_local_optim"
SEMI_SYNC_GLOBAL_STATE_KEY: str = "semi_sync_global_"
SEMI_SYNC_LOCAL_STATE_KEY: str = "semi_sync_local_"
SEMISYNC_GLOBAL_STEP_COUNTER_KEY: str = "__semisync_global_step_counter__"
SEMISYNC_LOCAL_STEP_COUNTER_KEY: str = "__semisync_local_step_counter__"


class EmptyGlobalParamsError(ValueError, IndexError):
    """No global parameters (an IndexError in TorchRec, which indexes the first one)."""


def _unprefixed(param_state: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in param_state.items() if k.startswith(prefix)}


class SemisyncOptimizer(KeyedOptimizer):
    """A local optimizer stepped every step and a global one every ``num_local_steps``.

    Args:
        global_params: the parameters the global optimizer synchronizes (tensors or groups).
        optimizer: the local KeyedOptimizer.
        global_optimizer: a KeyedOptimizer whose ``_optimizer`` has
            ``global_step(local_step_counter, closure)``.
        num_local_steps: local steps between two global steps.
        semi_sync_worker_shard_group, offload_global_model, non_blocking: kept for the global
            optimizer's use (TorchRec's signature).
    """

    def __init__(
        self,
        global_params: Iterable[Any],
        optimizer: KeyedOptimizer,
        global_optimizer: KeyedOptimizer,
        num_local_steps: int = 16,
        semi_sync_worker_shard_group: dist.ProcessGroup | None = None,
        offload_global_model: bool = False,
        non_blocking: bool = False,
    ) -> None:
        if global_params is None:
            raise ValueError("SemisyncOptimizer: global_params must be provided")
        if num_local_steps < 1:
            raise ValueError(f"SemisyncOptimizer: num_local_steps must be >= 1, got {num_local_steps}")
        init_optimizer_attributes(self)
        self._optimizer = optimizer
        self._global_optimizer = global_optimizer
        entries = list(global_params)
        if not entries:
            raise EmptyGlobalParamsError(
                "SemisyncOptimizer: global_params is empty; pass the parameters the global "
                "optimizer synchronizes"
            )
        if isinstance(entries[0], dict):
            self._worker_model_params = [p for group in entries for p in group["params"]]
        else:
            self._worker_model_params = [p for p in entries if isinstance(p, torch.Tensor)]
        self._num_local_steps = num_local_steps
        self._local_step_counter = torch.tensor(0, dtype=torch.int64, device="cpu")
        self._global_step_counter = torch.tensor(0, dtype=torch.int64, device="cpu")
        self._worker_shard_group = semi_sync_worker_shard_group
        self._offload_global_model = offload_global_model
        self._non_blocking = non_blocking
        self.defaults: dict[str, Any] = {"_save_param_groups": False}

    @property
    def param_groups(self) -> list[Any]:
        return [g for opt in (self._optimizer, self._global_optimizer) for g in opt.param_groups]

    @property
    def params(self) -> dict[str, torch.Tensor]:
        out = dict(self._optimizer.params)
        for name, param in self._global_optimizer.params.items():
            if name in out and out[name] is not param:
                raise ValueError(
                    f"SemisyncOptimizer: parameter {name!r} names different tensors in the local "
                    "and the global optimizer; give both optimizers the same parameter objects"
                )
            out[name] = param
        out[SEMISYNC_GLOBAL_STEP_COUNTER_KEY] = self._global_step_counter
        out[SEMISYNC_LOCAL_STEP_COUNTER_KEY] = self._local_step_counter
        return out

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        out = {
            param: {SEMI_SYNC_LOCAL_STATE_KEY + k: v for k, v in state.items()}
            for param, state in self._optimizer.state.items()
        }
        for param, state in self._global_optimizer.state.items():
            merged = out.setdefault(param, {})
            merged.update({SEMI_SYNC_GLOBAL_STATE_KEY + k: v for k, v in state.items()})
            merged[SEMISYNC_GLOBAL_STEP_COUNTER_KEY] = self._global_step_counter
            merged[SEMISYNC_LOCAL_STEP_COUNTER_KEY] = self._local_step_counter
        return out

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self._local_step_counter.add_(1)
        local_steps = int(self._local_step_counter.item())
        self._optimizer.step(closure)
        if local_steps % self._num_local_steps == 0:
            self._global_step_counter.add_(1)
            self._global_optimizer.zero_grad()  # release gradient memory before the outer step
            self._global_optimizer._optimizer.global_step(  # type: ignore[attr-defined]
                self._local_step_counter, closure
            )
            logger.info(
                "Finished global optimizer step %d (after %d local steps)",
                int(self._global_step_counter.item()), local_steps,
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)
        self._global_optimizer.zero_grad(set_to_none=set_to_none)

    def post_load_state_dict(self) -> None:
        """Restore the step counters and give each optimizer back its own (un-prefixed) state."""
        combined = self.state
        self._restore_counters(combined)
        for opt, prefix in (
            (self._optimizer, SEMI_SYNC_LOCAL_STATE_KEY),
            (self._global_optimizer, SEMI_SYNC_GLOBAL_STATE_KEY),
        ):
            own = set(opt.state.keys())
            state = {
                param: _unprefixed(param_state, prefix)
                for param, param_state in combined.items()
                if param in own and any(k.startswith(prefix) for k in param_state)
            }
            if state:
                opt.state.clear()
                opt.state.update(state)
        for opt in (self._optimizer, self._global_optimizer):
            opt.post_load_state_dict()

    @staticmethod
    def _extract_prefixed_state(param_state: dict[str, Any], prefix: str) -> dict[str, Any]:
        """The entries of ``param_state`` whose key starts with ``prefix``, prefix removed."""
        return _unprefixed(param_state, prefix)

    def _restore_counters(self, combined: dict[torch.Tensor, Any]) -> None:
        found: dict[str, torch.Tensor] = {}
        for param_state in combined.values():
            for key in (SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY):
                if key in param_state and key not in found:
                    found[key] = param_state[key]
        missing = [
            name for name, key in (("global", SEMISYNC_GLOBAL_STEP_COUNTER_KEY),
                                   ("local", SEMISYNC_LOCAL_STEP_COUNTER_KEY))
            if key not in found
        ]
        if missing:
            raise RuntimeError(
                f"Missing {' and '.join(missing)} step counter(s) in checkpoint; it was not saved "
                "by a SemisyncOptimizer with a stateful global optimizer"
            )
        self._global_step_counter = found[SEMISYNC_GLOBAL_STEP_COUNTER_KEY]
        self._local_step_counter = found[SEMISYNC_LOCAL_STEP_COUNTER_KEY]

    def save_param_groups(self, save: bool) -> None:
        self.defaults["_save_param_groups"] = save
        self._optimizer.save_param_groups(save)
        self._global_optimizer.save_param_groups(save)

    def __repr__(self) -> str:
        return (
            f"{SEMI_SYNC_LOCAL_OPTIM_KEY}: {self._optimizer!r}, "
            f"{SEMI_SYNC_GLOBAL_OPTIM_KEY}: {self._global_optimizer!r}"
        )

    def scratch_buffers(self) -> tuple[torch.Tensor, ...]:
        """The local then the global optimizer's scratch buffers (TorchRec 1.9)."""
        return inner_scratch_buffers([self._optimizer, self._global_optimizer])

    def set_optimizer_step(self, step: int) -> None:
        set_inner_optimizer_step([self._optimizer, self._global_optimizer], step)

    def update_hyper_parameters(self, params_dict: dict[str, Any]) -> None:
        update_inner_hyper_parameters([self._optimizer, self._global_optimizer], params_dict)
