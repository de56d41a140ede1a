"""Loss scaling for fp16 training (Megatron's constant and dynamic grad scalers).

fp16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by a scale
``S`` before backward, so every gradient is ``S`` times larger in fp16; the optimizer divides the
float32 main gradients by ``S`` before it clips and steps. A dynamic scaler starts high and halves
``S`` whenever a gradient overflowed (that step is skipped), ``hysteresis`` overflows in a row
allowing one halving; after ``growth_interval`` steps without overflow it doubles ``S``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_het.errors import UserError


@dataclass
class LossScaler:
    """The scale of the loss and how it moves.

    ``dynamic=False`` keeps ``scale`` fixed (Megatron's ``--loss-scale``). Otherwise
    :meth:`update` halves it (not below ``min_scale``) after ``hysteresis`` overflowing steps
    and doubles it after ``growth_interval`` clean steps in a row.
    """

    scale: float = 2.0**32
    dynamic: bool = True
    min_scale: float = 1.0
    growth_interval: int = 1000
    hysteresis: int = 2
    clean_steps: int = 0
    hysteresis_left: int | None = None  # overflows left before a halving; starts full

    def __post_init__(self) -> None:
        if self.hysteresis_left is None:
            self.hysteresis_left = self.hysteresis
        if self.scale <= 0 or self.min_scale <= 0:
            raise UserError(
                f"the loss scale ({self.scale}) and --min-loss-scale "
                f"({self.min_scale}) must be positive"
            )
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise UserError("--loss-scale-window and --hysteresis must be at least 1")

    def update(self, found_inf: bool) -> None:
        """After a step: ``found_inf`` says whether a gradient overflowed (step skipped).

        Raises UserError when gradients overflow at the smallest scale (fp16 cannot represent
        them; train in bf16)."""
        if not self.dynamic:
            if found_inf:
                raise UserError(
                    f"the gradients overflow fp16 at --loss-scale {self.scale:g}; "
                    "lower it, drop it for dynamic scaling, or use --bf16"
                )
            return
        if not found_inf:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2.0
                self.hysteresis_left = self.hysteresis
            return
        if self.scale <= self.min_scale:
            raise UserError(
                f"the gradients overflow fp16 even at loss scale {self.scale:g} "
                "(--min-loss-scale); use --bf16"
            )
        self.clean_steps = 0
        assert self.hysteresis_left is not None  # __post_init__ fills it
        self.hysteresis_left -= 1
        if self.hysteresis_left <= 0:
            self.scale = max(self.min_scale, self.scale / 2.0)
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
