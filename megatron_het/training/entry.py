"""``pretrain_llama.py``'s main: parse the command line, then dry-run or train."""
from __future__ import annotations

import sys
from typing import Mapping, Sequence

from megatron_het.arguments import parse_run_config


def main(argv: Sequence[str], environ: Mapping[str, str]) -> None:
    """Parse ``argv`` (without the program name) and run it: ``--dry-run`` checks and
    predicts; otherwise train on torchrun's world (``environ`` has its variables) or on this
    process alone. SIGTERM asks the run to save and stop at the end of the iteration."""
    run = parse_run_config(argv)
    # Imported after parsing so --help and command-line mistakes answer without loading torch.
    from megatron_het.training.launch import (launched_by_torchrun, local_accelerator,
                                              read_launch_env)
    from megatron_het.training.run import pretrain
    from megatron_het.training.stop import StopRequest

    accelerator = "cpu" if run.parallel.cluster else local_accelerator()
    if run.parallel.dry_run:
        from megatron_het.training.dry_run import dry_run

        dry_run(run, sys.stdout, accelerator)
        return
    stop = StopRequest()
    stop.install()
    env = read_launch_env(environ) if launched_by_torchrun(environ) else None
    pretrain(run, env, stop=stop, accelerator=accelerator)
