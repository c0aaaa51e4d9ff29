"""Optimizers whose state is keyed by parameter name, so checkpoints survive resharding.

``KeyedOptimizer`` is a ``torch.optim.Optimizer`` (LR schedulers work on it) whose
``state_dict()`` uses parameter names instead of positions. ``CombinedOptimizer`` steps several
of them as one, e.g. the fused embedding optimizer plus a dense optimizer for the MLPs.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch


class KeyedOptimizer(torch.optim.Optimizer):
    """An optimizer over ``params: {name: tensor}`` with name-keyed state.

    ``state`` maps each parameter tensor to its state dict; ``param_groups`` are ordinary torch
    param groups (their ``"params"`` lists hold the tensors).
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        state: Mapping[Any, Any],
        param_groups: Collection[Mapping[str, Any]],
    ) -> None:
        # torch.optim.Optimizer.__init__ refuses an empty parameter list, but a rank that holds
        # no embedding shard has exactly that; set up the same attributes directly.
        torch._C._log_api_usage_once("python.optimizer")
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True
        self.state = state if isinstance(state, defaultdict) else defaultdict(dict, state)
        self.param_groups = param_groups if isinstance(param_groups, list) else [
            dict(g) for g in param_groups
        ]
        self.params = dict(params)
        self._check_groups()

    def _check_groups(self) -> None:
        known = {id(p) for p in self.params.values()}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError("KeyedOptimizer: a param group holds a tensor not in params")

    def _names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.params.items()}

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {name: {key: value}}, "param_groups": [{"params": [names], ...}]}``."""
        names = self._names()
        state = {names[id(p)]: dict(s) for p, s in self.state.items() if id(p) in names}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in self.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy a name-keyed state dict in place (tensors keep their storage)."""
        loaded_state = state_dict["state"]
        for name, param in self.params.items():
            current = self.state.get(param)
            if current is None and name not in loaded_state:
                continue
            if name not in loaded_state:
                raise ValueError(
                    f"optimizer state_dict has no state for parameter {name!r}; it was saved from "
                    "a different model or optimizer"
                )
            target = self.state[param]
            for key, value in loaded_state[name].items():
                if isinstance(value, torch.Tensor) and isinstance(target.get(key), torch.Tensor):
                    if target[key].shape != value.shape:
                        raise ValueError(
                            f"optimizer state {name!r}[{key!r}]: shape {tuple(value.shape)} in the "
                            f"checkpoint, {tuple(target[key].shape)} here"
                        )
                    with torch.no_grad():
                        target[key].copy_(value)
                else:
                    target[key] = value.clone() if isinstance(value, torch.Tensor) else value
        loaded_groups = state_dict["param_groups"]
        if len(loaded_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state_dict has {len(loaded_groups)} param groups, this optimizer "
                f"has {len(self.param_groups)}"
            )
        names = self._names()
        for group, loaded in zip(self.param_groups, loaded_groups, strict=True):
            mine = [names[id(p)] for p in group["params"]]
            if list(loaded["params"]) != mine:
                raise ValueError(
                    f"optimizer param group holds {list(loaded['params'])} in the checkpoint but "
                    f"{mine} here"
                )
            for key, value in loaded.items():
                if key != "params":
                    group[key] = value

    def init_state(self) -> None:
        """Materialize lazily created state (e.g. Adam's) by one step with zero gradients."""
        for param in self.params.values():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        saved = [dict(g) for g in self.param_groups]
        for group in self.param_groups:
            if "lr" in group:
                group["lr"] = 0.0
        self.step()
        for group, old in zip(self.param_groups, saved, strict=True):
            group.update({k: v for k, v in old.items() if k != "params"})
        self.zero_grad(set_to_none=True)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        return closure() if closure is not None else None


class KeyedOptimizerWrapper(KeyedOptimizer):
    """Wraps a regular optimizer built by ``optim_factory(list_of_params)`` as a KeyedOptimizer.

    Example: ``KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
    lambda params: torch.optim.Adagrad(params, lr=0.01))``.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        optim_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    ) -> None:
        self._optimizer = optim_factory(list(params.values()))
        super().__init__(params, self._optimizer.state, self._optimizer.param_groups)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return repr(self._optimizer)


class CombinedOptimizer(KeyedOptimizer):
    """Several KeyedOptimizers stepped as one; names may be prefixed to keep keys unique."""

    def __init__(
        self, optims: Sequence[KeyedOptimizer | tuple[str, KeyedOptimizer]] | None = None
    ) -> None:
        self._optims: list[tuple[str, KeyedOptimizer]] = []
        for entry in optims or []:
            prefix, opt = entry if isinstance(entry, tuple) else ("", entry)
            self._optims.append((prefix, opt))
        params: dict[str, torch.Tensor] = {}
        for prefix, opt in self._optims:
            for name, p in opt.params.items():
                key = f"{prefix}.{name}" if prefix else name
                if key in params:
                    raise ValueError(
                        f"CombinedOptimizer: parameter {key!r} appears in two optimizers; give "
                        "them distinct prefixes with (prefix, optimizer) tuples"
                    )
                params[key] = p
        super().__init__(params, {}, [])

    @property
    def optimizers(self) -> list[tuple[str, KeyedOptimizer]]:
        return self._optims

    @property  # type: ignore[override]
    def state(self) -> defaultdict[torch.Tensor, Any]:
        merged: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for _, opt in self._optims:
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value: Any) -> None:  # set by the base __init__; state lives in members
        del value

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for _, opt in self._optims for g in opt.param_groups]

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        del value

    def _check_groups(self) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": {}, "param_groups": []}
        for prefix, opt in self._optims:
            sd = opt.state_dict()
            pre = f"{prefix}." if prefix else ""
            out["state"].update({pre + k: v for k, v in sd["state"].items()})
            for g in sd["param_groups"]:
                out["param_groups"].append({**g, "params": [pre + n for n in g["params"]]})
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        groups = list(state_dict["param_groups"])
        for prefix, opt in self._optims:
            pre = f"{prefix}." if prefix else ""
            n = len(opt.param_groups)
            mine, groups = groups[:n], groups[n:]
            opt.load_state_dict({
                "state": {
                    k[len(pre):]: v for k, v in state_dict["state"].items() if k.startswith(pre)
                },
                "param_groups": [
                    {**g, "params": [p[len(pre):] for p in g["params"]]} for g in mine
                ],
            })

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for _, opt in self._optims:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, opt in self._optims:
            opt.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return ",".join(f"{prefix}: {opt!r}" for prefix, opt in self._optims)
