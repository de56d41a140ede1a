"""``--dry-run``: check plan, cluster, model, batch and emulation without processes; print the
prediction (a composition root like :mod:`megatron_het.training.run`, which may wire emulation)."""

from __future__ import annotations

from typing import TextIO

from megatron_het.arguments import RunConfig
from megatron_het.training.describe import describe_plan
from megatron_het.training.setup import prepare_run


def dry_run(run: RunConfig, out: TextIO, accelerator: str = "cpu") -> None:
    """Validate everything a run checks at start (no world, nothing written) and print the
    plan and its predicted iteration time; UserError with one line on any mismatch."""
    from megatron_het.training.run import predict_run, rank_emulation

    setup = prepare_run(run, world_size=None, accelerator=accelerator)
    config, train = setup.model_config, setup.train
    # Every rank runs on one thread under torchrun; the dry run checks the ranks' emulation so.
    device_times = rank_emulation(setup, rank=0, threads=1).description
    prediction = predict_run(setup)
    print(
        f"> dry run: model {config.name} ({config.num_parameters() / 1e6:.2f}M parameters, "
        f"{config.num_layers} layers) on cluster {setup.cluster.name} "
        f"({setup.cluster.world_size} ranks), {setup.options.dtype}, global batch "
        f"{train.global_batch_size} = {train.micro_batch_size} x "
        f"{train.global_batch_size // train.micro_batch_size} micro-batches",
        file=out,
    )
    print(describe_plan(setup), file=out)
    if device_times:
        print(device_times, file=out)
    layers = "compiled (--compile)" if setup.options.fused_elementwise else "eager (no --compile)"
    print(f"> predicted (roofline/profile estimate, decoder layers {layers}):", file=out)
    print(prediction.table(), file=out)
    print(
        f"> predicted iteration time: {prediction.iteration_time_s:.4f} s; plan, cluster, "
        "model and batch are consistent",
        file=out,
        flush=True,
    )
