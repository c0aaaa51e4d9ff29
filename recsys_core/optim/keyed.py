"""Optimizers whose state is keyed by parameter name, so checkpoints survive resharding.

TorchRec's ``torchrec.optim.keyed`` semantics:

- ``KeyedOptimizer(params, state, param_groups)``: ``state_dict()`` is
  ``{"state": {name: {key: value}}}``; ``"param_groups"`` (each with its ``params`` as sorted
  names) is added only after ``save_param_groups(True)``. ``load_state_dict`` copies tensors in
  place and refuses a state dict whose parameters, state sizes or shapes differ: run
  ``init_state()`` (one step with zero gradients) before loading into a fresh optimizer.
- ``CombinedOptimizer([opt, ("prefix", opt), ...])``: one optimizer over several, parameter
  names prefixed ``"prefix.name"``.
- ``KeyedOptimizerWrapper(params, optim_factory)`` wraps a ``torch.optim`` optimizer;
  ``OptimizerWrapper(keyed)`` is the base of ``GradientClippingOptimizer`` and
  ``WarmupOptimizer``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import optim

from recsys_core.optim._state import (
    init_optimizer_attributes,
    inner_scratch_buffers,
    load_param_groups,
    load_param_state,
    named_param_groups,
    route_key,
    set_inner_optimizer_step,
    state_content,
    update_inner_hyper_parameters,
)

OptimizerFactory = Callable[[Any], optim.Optimizer]


class KeyedOptimizer(optim.Optimizer):
    """An optimizer over ``params: {name: tensor}`` whose state dict is keyed by name.

    ``state`` ({param tensor: {key: value}}) and ``param_groups`` are kept as given (shared
    with a wrapped optimizer, not copied). Every ``state`` key must be one of ``params``.
    ``step()`` is not implemented here: subclasses or wrappers provide it.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        state: Mapping[Any, Any],
        param_groups: Collection[Mapping[str, Any]],
    ) -> None:
        init_optimizer_attributes(self)
        self.state = state  # type: ignore[assignment]
        self.param_groups = param_groups  # type: ignore[assignment]
        self.params = params
        self.defaults: dict[str, Any] = {"_save_param_groups": False}
        known = {id(p) for p in params.values()}
        strays = [key for key in state if id(key) not in known]
        if strays:
            shown = [k if not isinstance(k, torch.Tensor) else f"tensor{tuple(k.shape)}" for k in strays]
            raise ValueError(
                f"All state keys must be params. The following keys are not: {shown}. Key the "
                "state by the parameter tensors given in params."
            )

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {name: state}}``, plus ``"param_groups"`` after ``save_param_groups(True)``.

        Tensors are returned as they are (not copied), so a checkpoint loader can fill them in
        place; objects with a ``state_dict()`` are replaced by it.
        """
        names = {id(p): name for name, p in self.params.items()}
        state: dict[str, Any] = {}
        for param, param_state in self.state.items():
            if id(param) not in names:
                raise ValueError(
                    f"{type(self).__name__}: the state holds a tensor of shape "
                    f"{tuple(param.shape)} that is not in params; every stateful tensor must be "
                    "given a name in params"
                )
            state[names[id(param)]] = state_content(param_state)
        out: dict[str, Any] = {"state": state}
        if self.defaults["_save_param_groups"]:
            out["param_groups"] = named_param_groups(self.param_groups, self.params)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy a name-keyed state dict in place, then ``post_load_state_dict()``.

        Stricter than ``torch.optim``: the state must hold the same parameters with the same
        number of entries (and shapes) as this optimizer's; param groups are loaded (matched by
        their parameter names) only after ``save_param_groups(True)``.
        """
        new_state = state_dict["state"]
        if len(self.state) != len(new_state):
            raise ValueError(
                f"Different parameter count: {len(self.state)} vs {len(new_state)} (this "
                f"optimizer holds state for {sorted(self._state_names())}, the state_dict for "
                f"{sorted(new_state)}); call init_state() first so that lazily created state "
                "exists, and load a state_dict saved from the same parameters"
            )
        for name, param in self.params.items():
            if param not in self.state:
                continue
            if name not in new_state:
                raise ValueError(
                    f"Parameter {name} not found in the state_dict (it has {sorted(new_state)})"
                )
            current, loaded = self.state[param], new_state[name]
            if len(current) != len(loaded):
                raise ValueError(
                    f"Different state size: {len(current)} vs {len(loaded)} for parameter "
                    f"{name} (here {sorted(current)}, in the state_dict {sorted(loaded)}); it "
                    "was saved by a different optimizer"
                )
            load_param_state(current, loaded, [name])
        if self.defaults["_save_param_groups"]:
            if "param_groups" not in state_dict:
                raise ValueError(
                    "the state_dict has no 'param_groups' but save_param_groups(True) is set; "
                    "save it with save_param_groups(True) or call save_param_groups(False)"
                )
            load_param_groups(self.param_groups, state_dict["param_groups"], self.params)
        self.post_load_state_dict()

    def _state_names(self) -> list[str]:
        names = {id(p): name for name, p in self.params.items()}
        return [names.get(id(p), "?") for p in self.state]

    def post_load_state_dict(self) -> None:
        """Called at the end of ``load_state_dict``; subclasses re-derive what the state sets."""

    def add_param_group(self, param_group: Any) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}.add_param_group: a KeyedOptimizer's groups are fixed at "
            "construction; build a new optimizer (or a CombinedOptimizer) instead"
        )

    def init_state(self, sparse_grad_parameter_names: set[str] | None = None) -> None:
        """Create lazily initialized state (e.g. Adam's moments) with one ``step()``.

        Every parameter that requires grad gets a zero gradient (a sparse zero gradient for the
        names in ``sparse_grad_parameter_names``), then ``step()`` runs at the configured learning
        rate, as TorchRec does: the gradients are left in place, state such as Adam's ``step``
        advances to 1, and weight decay (which does not depend on the gradient) is applied once.
        """
        for name, param in self.params.items():
            if param.requires_grad:
                grad = torch.zeros_like(param)
                if sparse_grad_parameter_names is not None and name in sparse_grad_parameter_names:
                    grad = grad.to_sparse()
                param.grad = grad
        self.step(closure=None)

    def save_param_groups(self, save: bool) -> None:
        """Whether ``state_dict()`` includes (and ``load_state_dict`` loads) ``param_groups``."""
        self.defaults["_save_param_groups"] = save

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__


class _WrappedOptimizerCalls:
    """What both wrappers pass straight to the optimizer they wrap (``_optimizer``): the step,
    its scratch buffers, its step counter and hyper-parameter updates."""

    _optimizer: Any

    def step(self, closure: Any = None) -> None:
        self._optimizer.step(closure=closure)

    def scratch_buffers(self) -> tuple[torch.Tensor, ...]:
        """The wrapped optimizer's scratch buffers (TorchRec 1.9; none unless it has some)."""
        return inner_scratch_buffers([self._optimizer])

    def set_optimizer_step(self, step: int) -> None:
        set_inner_optimizer_step([self._optimizer], step)

    def update_hyper_parameters(self, params_dict: dict[str, Any]) -> None:
        update_inner_hyper_parameters([self._optimizer], params_dict)


class KeyedOptimizerWrapper(_WrappedOptimizerCalls, KeyedOptimizer):
    """A ``torch.optim`` optimizer built by ``optim_factory`` as a KeyedOptimizer.

    ``optim_factory`` receives ``list(params.values())``, or the ``params`` dict itself when
    ``pass_params_dict=True``. Example: ``KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(
    model.named_parameters())), lambda params: torch.optim.Adagrad(params, lr=0.01))``.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        optim_factory: OptimizerFactory,
        pass_params_dict: bool = False,
    ) -> None:
        self._optimizer = optim_factory(params if pass_params_dict else list(params.values()))
        super().__init__(params, self._optimizer.state, self._optimizer.param_groups)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Calls the wrapped optimizer's ``zero_grad()`` with its own default (``set_to_none``
        is not forwarded, as in TorchRec: gradients become None)."""
        self._optimizer.zero_grad()


class OptimizerWrapper(_WrappedOptimizerCalls, KeyedOptimizer):
    """A KeyedOptimizer that delegates to another one (``params``, ``state`` and
    ``param_groups`` are the wrapped optimizer's own objects). Base of the clipping and warmup
    wrappers, which override ``step``."""

    def __init__(self, optimizer: KeyedOptimizer) -> None:
        init_optimizer_attributes(self)
        self._optimizer = optimizer
        self.params = optimizer.params
        self.state = optimizer.state
        self.param_groups = optimizer.param_groups
        self.defaults = {"_save_param_groups": False}

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def post_load_state_dict(self) -> None:
        self._optimizer.post_load_state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)
        self.state = self._optimizer.state
        self.param_groups = self._optimizer.param_groups
        self.post_load_state_dict()

    def save_param_groups(self, save: bool) -> None:
        self._optimizer.save_param_groups(save)



class CombinedOptimizer(KeyedOptimizer):
    """Several KeyedOptimizers stepped, zeroed and checkpointed as one.

    ``optims`` holds optimizers or ``(prefix, optimizer)`` pairs; a parameter ``name`` of a
    prefixed optimizer is ``"prefix.name"`` here (names must be unique). ``params``, ``state`` and
    ``param_groups`` are views over the members, built on each access. The state dict is the
    members' state dicts, prefixed, so a member that builds its own (a sharded fused optimizer)
    keeps its layout.
    """

    def __init__(self, optims: Sequence[KeyedOptimizer | tuple[str, KeyedOptimizer]] | None = None) -> None:
        init_optimizer_attributes(self)
        self._optims: list[tuple[str, KeyedOptimizer]] = [
            entry if isinstance(entry, tuple) else ("", entry) for entry in optims or []
        ]
        flags = {opt.defaults["_save_param_groups"] for _, opt in self._optims}
        if len(flags) > 1:
            raise ValueError(
                "CombinedOptimizer: members disagree on save_param_groups; call "
                "save_param_groups() on the CombinedOptimizer to set it for all of them"
            )
        self.defaults: dict[str, Any] = {"_save_param_groups": flags.pop() if flags else False}
        seen: set[str] = set()
        for prefix, opt in self._optims:
            for name in opt.params:
                key = self.prepend_opt_key(name, prefix)
                if key in seen:
                    raise ValueError(
                        f"Duplicate param key {key}: two optimizers name a parameter alike; give "
                        "them distinct prefixes with (prefix, optimizer) pairs"
                    )
                seen.add(key)

    def __repr__(self) -> str:
        return ",".join(f"{prefix}: {opt!r}" for prefix, opt in self._optims)

    @staticmethod
    def prepend_opt_key(name: str, opt_key: str) -> str:
        if not name:
            return opt_key
        return opt_key + ("." if opt_key else "") + name

    @property
    def optimizers(self) -> list[tuple[str, KeyedOptimizer]]:
        return self._optims

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return {
            self.prepend_opt_key(name, prefix): p
            for prefix, opt in self._optims for name, p in opt.params.items()
        }

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return {p: s for _, opt in self._optims for p, s in opt.state.items()}

    @property
    def param_groups(self) -> list[Any]:
        return [group for _, opt in self._optims for group in opt.param_groups]

    def zero_grad(self, set_to_none: bool = False) -> None:
        for _, opt in self._optims:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for _, opt in self._optims:
            opt.step(closure=closure)

    def state_dict(self) -> dict[str, Any]:
        """The members' state dicts with prefixed names. ``param_groups`` is present after
        ``save_param_groups(True)``, or when a member always saves its own."""
        state: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        has_groups = self.defaults["_save_param_groups"]
        for prefix, opt in self._optims:
            member = opt.state_dict()
            state.update({self.prepend_opt_key(k, prefix): v for k, v in member["state"].items()})
            if "param_groups" in member:
                has_groups = True
                member_groups = member["param_groups"]
            elif self.defaults["_save_param_groups"]:
                member_groups = named_param_groups(opt.param_groups, opt.params)
            else:
                member_groups = []
            groups += [
                {**g, "params": [self.prepend_opt_key(n, prefix) for n in g["params"]]}
                for g in member_groups
            ]
        return {"state": state, "param_groups": groups} if has_groups else {"state": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Split the state dict by prefix (and, among equal prefixes, by parameter name) and
        load each member's part into it; every entry must belong to a member."""
        parts: list[dict[str, Any]] = [{"state": {}} for _ in self._optims]
        for key, value in state_dict["state"].items():
            index, name = self._owner(key)
            parts[index]["state"][name] = value
        if "param_groups" in state_dict:
            for part in parts:
                part["param_groups"] = []
            for group in state_dict["param_groups"]:
                owners = {self._owner(key) for key in group["params"]}
                indices = {index for index, _ in owners}
                if len(indices) != 1:
                    raise ValueError(
                        f"param group {group['params']} spans {len(indices)} member optimizers; "
                        "each group must belong to exactly one"
                    )
                index = indices.pop()
                parts[index]["param_groups"].append(
                    {**group, "params": sorted(name for _, name in owners)}
                )
        for (_, opt), part in zip(self._optims, parts, strict=True):
            opt.load_state_dict(part)

    def _owner(self, key: str) -> tuple[int, str]:
        return route_key(key, [(prefix, opt.params) for prefix, opt in self._optims])

    def post_load_state_dict(self) -> None:
        for _, opt in self._optims:
            opt.post_load_state_dict()

    def save_param_groups(self, save: bool) -> None:
        self.defaults["_save_param_groups"] = save
        for _, opt in self._optims:
            opt.save_param_groups(save)

    def scratch_buffers(self) -> tuple[torch.Tensor, ...]:
        """Every sub-optimizer's scratch buffers, in order (TorchRec 1.9)."""
        return inner_scratch_buffers(opt for _, opt in self._optims)

    def set_optimizer_step(self, step: int) -> None:
        set_inner_optimizer_step((opt for _, opt in self._optims), step)

    def update_hyper_parameters(self, params_dict: dict[str, Any]) -> None:
        update_inner_hyper_parameters((opt for _, opt in self._optims), params_dict)


__all__ = [
    "CombinedOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerFactory",
    "OptimizerWrapper",
]
