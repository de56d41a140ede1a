"""The training entry points, loops, logging and resumable state: single-process and distributed
(`distributed.py`, driven by a parallel plan over the unified communicator)."""
from megatron_het.training.loop import (StepResult, StopRequest, evaluate, forward_backward,
                                        get_micro_batches, optimizer_step, train_step)
from megatron_het.training.pretrain import pretrain

__all__ = ["StepResult", "StopRequest", "evaluate", "forward_backward", "get_micro_batches",
           "optimizer_step", "pretrain", "train_step"]
