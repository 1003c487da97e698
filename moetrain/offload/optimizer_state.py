"""The state dict of :class:`moetrain.offload.OffloadOptimizer`: ``state_dict`` (torch's Adam layout
plus ``master``, and ``pending`` under ``overlap="delayed"``) and ``load_state_dict`` (checks
everything, then copies into the optimizer's own host buffers and the model's parameters), with
the param-group option check and the helpers both halves of the optimizer share.

A mixin: it uses the optimizer's ``state``, ``param_groups``, ``overlap``, ``_pending``,
``_new_master``, ``wait_pending`` and ``apply_pending``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from moetrain.validation import require_bool, require_nonneg_float, require_numbers

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "master")
# ``overlap="delayed"`` adds to each param's state dict entry (never to ``optimizer.state``):
# ``pending``, a 0-dim fp32 tensor, 1.0 when ``master`` is one update ahead of the model's weight.
PENDING_KEY = "pending"


def check_group_options(where: str, group: dict[str, Any]) -> None:
    """ValueError naming the first bad hyper-parameter of a param group (NaN is out of range)."""
    for key in ("lr", "eps", "weight_decay"):
        require_nonneg_float(f"{where}: {key}", group[key])
    require_numbers(f"{where}: betas", group["betas"], count=2, low=0, high=1, high_open=True)
    decoupled = group["decoupled_weight_decay"]
    require_bool(f"{where}: decoupled_weight_decay", decoupled, note="(True: AdamW, False: Adam)")
    for key in ("amsgrad", "maximize"):
        if group.get(key, False):
            raise ValueError(f"{where}: {key} must be False (not supported), got {group[key]!r}")


def is_same_memory(master: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``master`` is the parameter's own memory (an fp32 CPU model)."""
    return master.device == param.device and master.data_ptr() == param.data_ptr()


def _deep_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_deep_copy(item) for item in value)
    if isinstance(value, dict):
        return {key: _deep_copy(item) for key, item in value.items()}
    return value


class OptimizerStateMixin:
    """``state_dict`` / ``load_state_dict`` of ``OffloadOptimizer``."""

    def state_dict(self) -> dict[str, Any]:
        """torch's Adam layout plus ``master`` per param; waits for the update in flight first.
        ``overlap="delayed"``: every param's entry also has ``pending`` (1.0: its weight in the
        model lacks the last update, which ``master`` holds; see the class docstring)."""
        self.wait_pending()
        state_dict = super().state_dict()
        if self.overlap == "delayed":
            params = [param for group in self.param_groups for param in group["params"]]
            for index, values in list(state_dict["state"].items()):
                pending = float(params[index] in self._pending)
                state_dict["state"][index] = {**values, PENDING_KEY: torch.tensor(pending)}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class, or of ``torch.optim.Adam`` / ``AdamW`` / ``CPUAdam``.

        Every tensor is copied into this optimizer's own host buffers (nothing of ``state_dict`` is
        kept). A param's ``master`` (taken from the param when the dict has none, as torch's do) is
        also written, cast, into the model's parameter, so that weights equal the cast master.
        Params without an entry in ``state_dict["state"]`` lose their state (fresh moments).
        Everything is checked before anything changes. Load-state-dict hooks run as in torch.
        A param whose entry has ``pending`` 1.0 (a checkpoint of ``overlap="delayed"``) keeps its
        weight until the next ``step()`` / ``apply_pending()`` writes the cast master (at once with
        ``overlap="none"``); an update in flight here is waited for and dropped.
        """
        self.wait_pending()
        self._pending = {}
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        id_to_param, new_groups = self._loaded_param_groups(state_dict["param_groups"])
        loaded = self._checked_loaded_state(state_dict["state"], id_to_param)
        new_state, deferred = self._copy_loaded_state(loaded)
        self.state = new_state
        self.param_groups[:] = new_groups
        self._pending = dict.fromkeys(deferred)
        if self.overlap == "none":
            self.apply_pending()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _loaded_param_groups(
        self, saved_groups: list[dict[str, Any]]
    ) -> tuple[dict[Any, torch.Tensor], list[dict[str, Any]]]:
        """Checks the saved param groups against this optimizer's; returns ``{saved param id:
        param}`` and the new param groups (copies of the saved options, this optimizer's params)."""
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"OffloadOptimizer.load_state_dict: param_groups must have {len(self.param_groups)} "
                f"groups like this optimizer, got {len(saved_groups)}"
            )
        id_to_param, new_groups = {}, []
        for index, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"OffloadOptimizer.load_state_dict: param group {index} must have "
                    f"{len(group['params'])} params, got {len(saved['params'])}"
                )
            id_to_param.update(zip(saved["params"], group["params"], strict=True))
            new_group = {key: _deep_copy(value) for key, value in saved.items() if key != "params"}
            new_group.setdefault("decoupled_weight_decay", group["decoupled_weight_decay"])
            new_group["params"] = group["params"]
            check_group_options(f"OffloadOptimizer.load_state_dict: param group {index}", new_group)
            new_groups.append(new_group)
        return id_to_param, new_groups

    @staticmethod
    def _checked_loaded_state(
        saved_state: dict[Any, dict[str, Any]], id_to_param: dict[Any, torch.Tensor]
    ) -> dict[torch.Tensor, dict[str, Any]]:
        """``{param: saved entry}`` after checking each entry's id, keys and tensor shapes."""
        loaded = {}
        for param_id, values in saved_state.items():
            where = f"OffloadOptimizer.load_state_dict: state of param id {param_id!r}"
            if param_id not in id_to_param:
                raise ValueError(f"{where}: the id must be one of the param groups' params")
            param = id_to_param[param_id]
            unknown = sorted(set(values) - {*STATE_KEYS, PENDING_KEY})
            missing = [key for key in ("step", "exp_avg", "exp_avg_sq") if key not in values]
            if unknown or missing:
                raise ValueError(
                    f"{where}: keys must be {STATE_KEYS} ('master' and {PENDING_KEY!r} optional), "
                    f"got {sorted(values)}"
                )
            for key in ("exp_avg", "exp_avg_sq", "master"):
                if key in values and tuple(values[key].shape) != tuple(param.shape):
                    raise ValueError(
                        f"{where}: {key} must have the param's shape {tuple(param.shape)}, "
                        f"got {tuple(values[key].shape)}"
                    )
            loaded[param] = values
        return loaded

    def _copy_loaded_state(
        self, loaded: dict[torch.Tensor, dict[str, Any]]
    ) -> tuple[defaultdict[torch.Tensor, dict[str, Any]], list[torch.Tensor]]:
        """Copies the checked entries into host buffers (reusing a param's existing ones) and the
        masters into the params; returns the new state and the params whose weight is deferred
        (``pending`` 1.0: written by the next ``step()`` / ``apply_pending()``)."""
        new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        deferred = []
        for param, values in loaded.items():
            state = self.state.get(param) or {}
            if not state:
                state = {
                    "exp_avg": torch.empty(param.shape, dtype=torch.float32),
                    "exp_avg_sq": torch.empty(param.shape, dtype=torch.float32),
                    "master": self._new_master(param),
                }
            state["step"] = torch.tensor(float(values["step"]), dtype=torch.float32)
            state["exp_avg"].copy_(values["exp_avg"])
            state["exp_avg_sq"].copy_(values["exp_avg_sq"])
            master = state["master"]
            if is_same_memory(master, param):
                if "master" in values:
                    master.copy_(values["master"])  # writes the param
            else:
                master.copy_(values["master"] if "master" in values else param.detach())
                if float(values.get(PENDING_KEY, 0.0)) != 0.0 and "master" in values:
                    deferred.append(param)  # written by the next step(), as the saved run would have
                else:
                    param.detach().copy_(master)
            new_state[param] = state
        return new_state, deferred
