"""``pretrain_llama.py``'s main: parse the command line, then dry-run or train."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from megatron_het.arguments import parse_run_config


def main(argv: Sequence[str], environ: Mapping[str, str]) -> None:
    """Parse ``argv`` (without the program name) and run it: ``--dry-run`` checks and
    predicts; otherwise train on torchrun's world (``environ`` has its variables) or on this
    process alone. SIGTERM asks the run to save and stop at the end of the iteration.

    Under an elastic supervisor, a rank that ends with an error of its own (not a lost peer)
    records it in its ``--save`` for the supervisors (:func:`~megatron_het.launcher.
    failure_record.record_own_error`) before the error goes on to its usual report."""
    from megatron_het.errors import PeerFailure

    try:
        _main(argv, environ)
    except PeerFailure:
        raise
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _record(argv, environ, exc)
        raise
    except Exception as exc:
        _record(argv, environ, exc)
        raise


def _record(argv: Sequence[str], environ: Mapping[str, str], error: BaseException) -> None:
    from megatron_het.launcher.failure_record import record_own_error

    record_own_error(_save_dir(argv), environ, error)


def _save_dir(argv: Sequence[str]) -> str | None:
    """``--save`` as the run's parser reads ``argv`` (None: not given, or a command line the
    parser refuses; there is no directory to record in then)."""
    from megatron_het.arguments import build_parser
    from megatron_het.errors import UserError

    try:
        return build_parser().parse_known_args(list(argv))[0].save
    except UserError:
        return None


def _main(argv: Sequence[str], environ: Mapping[str, str]) -> None:
    run = parse_run_config(argv)
    # Imported after parsing so --help and command-line mistakes answer without loading torch.
    from megatron_het.launcher.launch_env import launched_by_torchrun, read_launch_env
    from megatron_het.launcher.rank_device import local_accelerator
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
