"""The training entry point, loop, logging and resumable state (single device for now)."""
from megatron_het.training.loop import (StepResult, StopRequest, evaluate, forward_backward,
                                        get_micro_batches, optimizer_step, train_step)
from megatron_het.training.pretrain import pretrain

__all__ = ["StepResult", "StopRequest", "evaluate", "forward_backward", "get_micro_batches",
           "optimizer_step", "pretrain", "train_step"]
