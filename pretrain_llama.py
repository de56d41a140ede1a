"""Pretrain a Llama model with Megatron-style flags; see ``python pretrain_llama.py --help``.

One process trains on one device. Under torchrun (``python -m torch.distributed.run
--nproc_per_node N pretrain_llama.py ...``) with more than one rank, or with any parallel flag
(--cluster, --plan, --tensor/pipeline-model-parallel-size, ...), the run is spread over the
ranks as the plan says. ``--dry-run`` checks plan, cluster, model and batch and prints the plan's
predicted iteration time without starting processes.

SIGTERM makes the run save a checkpoint at the end of the current iteration (with --save; every
rank agrees on that iteration) and exit with status 0; resume it with --load.
"""
from __future__ import annotations

import os
import sys

from megatron_het.arguments import parse_run_config
from megatron_het.errors import run_cli


def main() -> None:
    run = parse_run_config(sys.argv[1:])
    # Imported after parsing so --help and command-line mistakes answer without loading torch.
    from megatron_het.training import StopRequest, pretrain
    from megatron_het.training.launch import launched_by_torchrun, read_launch_env

    if run.parallel.dry_run:
        from megatron_het.training.parallel_setup import dry_run

        dry_run(run, sys.stdout)
        return
    stop = StopRequest()
    stop.install()
    launched = launched_by_torchrun(os.environ)
    if run.parallel.requested or (launched and int(os.environ["WORLD_SIZE"]) > 1):
        from megatron_het.training.distributed import launch_and_train

        launch_and_train(run, read_launch_env(os.environ), stop=stop)
    else:
        pretrain(run, stop=stop)


if __name__ == "__main__":
    run_cli(main)
