"""AdamW over a model's parameters, with its state keyed by global parameter name.

Following Megatron-LM, 1-D parameters (the RMSNorm weights, and biases where a model has them)
get no weight decay; every other parameter, embeddings included, does. The optimizer's state is
saved and loaded by GLOBAL parameter name rather than by position, so a checkpoint does not depend
on the order in which a rank happens to build its parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_het.config import OptimizerConfig
from megatron_het.errors import UserError


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW parameter groups: ``decay`` (>= 2-D) and ``no_decay`` (1-D), with names.

    Each group carries ``param_names`` (global names, in ``named_parameters`` order) so the
    optimizer state can be translated to and from names. Empty groups are left out. Tied
    parameters appear once, under their first name.
    """
    decay: list[tuple[str, nn.Parameter]] = []
    no_decay: list[tuple[str, nn.Parameter]] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 else decay).append((name, param))
    groups = []
    for members, wd in ((decay, weight_decay), (no_decay, 0.0)):
        if members:
            groups.append(
                {
                    "params": [p for _, p in members],
                    "param_names": [n for n, _ in members],
                    "weight_decay": wd,
                }
            )
    return groups


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters (fp32 state on the parameters' device).

    The learning rate is set by the training loop before every step from the LR schedule; the
    value here is only the initial one. Uses torch's fused kernel where it has one
    (:func:`adamw_implementation`).
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        **adamw_implementation(device),
    )


# Device types torch's fused AdamW runs on (CUDA includes ROCm builds).
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def adamw_implementation(device: torch.device) -> dict[str, bool]:
    """``{"fused": True}`` on the devices of :data:`FUSED_ADAMW_DEVICES`, else the multi-tensor
    path. On a 2-core CPU host, one 7B layer's step (202M parameters) took 3-8x less time fused
    than foreach (bench.kernels' adamw case), so no AdamW kernel of our own is needed."""
    return {"fused": True} if device.type in FUSED_ADAMW_DEVICES else {"foreach": True}


def _names_by_index(optimizer: torch.optim.Optimizer) -> list[str]:
    names: list[str] = []
    for group in optimizer.param_groups:
        if "param_names" not in group:
            raise ValueError("optimizer groups must carry 'param_names' (use param_groups())")
        names.extend(group["param_names"])
    return names


def optimizer_state_by_name(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state as ``{"state": {name: {...}}, "param_groups": [...]}``.

    Per-parameter tensors (``exp_avg``, ``exp_avg_sq``, ``step``) are detached CPU copies.
    Each group's ``params`` list holds names instead of positions.
    """
    raw = optimizer.state_dict()
    names = _names_by_index(optimizer)
    state = {
        names[index]: {
            key: (value.detach().cpu().clone() if torch.is_tensor(value) else value)
            for key, value in entry.items()
        }
        for index, entry in raw["state"].items()
    }
    groups = []
    for group in raw["param_groups"]:
        group = dict(group)
        group["params"] = [names[index] for index in group["params"]]
        group.pop("param_names", None)
        groups.append(group)
    return {"state": state, "param_groups": groups}


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, state_by_name: dict[str, Any]
) -> None:
    """Load a state saved by :func:`optimizer_state_by_name` into ``optimizer`` in place.

    Matching is by parameter name; the hyper-parameters of the current groups (from the command
    line) are kept. Raises UserError when the saved state and the optimizer cover different
    parameters, naming a few of them.
    """
    names = _names_by_index(optimizer)
    saved = state_by_name["state"]
    missing = sorted(set(names) - set(saved))
    unexpected = sorted(set(saved) - set(names))
    if missing or unexpected:
        raise UserError(
            "checkpoint optimizer state does not match the model's parameters "
            f"(missing: {', '.join(missing[:3]) or 'none'}; unexpected: "
            f"{', '.join(unexpected[:3]) or 'none'}); load it with the model it was saved with"
        )
    current = optimizer.state_dict()
    optimizer.load_state_dict(
        {
            "state": {index: saved[name] for index, name in enumerate(names)},
            "param_groups": current["param_groups"],
        }
    )
