"""Relaunch a run on the devices that are left: the elastic supervisor of ``tools/elastic_run.py``.

    python tools/elastic_run.py [--max-restarts 3] -- --cluster C.yaml --save DIR ... (the
        flags of pretrain_llama.py)

The supervisor launches ``torchrun --standalone`` on every device of the cluster file (one
host; a multi-host job gets the same restart from its scheduler with the cluster file and
flags this module writes). When a run ends because a peer was lost, its reporting rank has
written ``DIR/last_failure.json`` (:func:`write_failure`: the ranks that stopped answering or
were stuck in compute). The supervisor then writes the cluster without those devices
(:func:`~megatron_het.cluster.shrink.without_ranks`) to ``DIR/elastic/cluster_<k>.yaml`` and
relaunches on it with ``--plan auto`` and ``--load DIR``: the run reshards the last committed
checkpoint to the new plan and continues at the same global batch and data position (the
start-up log says what changed). Any other end (success, a user error, a crash with no lost
peer, no restarts left) is the supervisor's exit status.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_het.cluster import ClusterSpec
from megatron_het.cluster.shrink import without_ranks
from megatron_het.errors import UserError

FAILURE_FILE = "last_failure.json"
PRETRAIN = Path(__file__).resolve().parents[2] / "pretrain_llama.py"
DEFAULT_MAX_RESTARTS = 3


def write_failure(save_dir: str | Path, iteration: int, world_size: int, silent: Sequence[int],
                  stuck: Sequence[int], failed: Sequence[int], line: str) -> Path:
    """Record a lost peer for a supervisor (atomically, in ``save_dir``): the ranks lost
    (``silent`` ones stopped answering, ``stuck`` ones stayed in compute), those that failed
    with an error of their own, the world size and the report line."""
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    record = {"iteration": iteration, "world_size": world_size,
              "lost_ranks": sorted(set(silent) | set(stuck)), "silent": list(silent),
              "stuck": list(stuck), "failed": list(failed), "line": line}
    tmp = root / f".{FAILURE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, root / FAILURE_FILE)
    return root / FAILURE_FILE


def read_failure(save_dir: str | Path) -> Optional[dict]:
    """The record :func:`write_failure` left in ``save_dir`` (None: none)."""
    path = Path(save_dir) / FAILURE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def flag_value(flags: Sequence[str], name: str) -> Optional[str]:
    """The value of ``--name V`` or ``--name=V`` in ``flags`` (the last one; None: absent)."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def with_flag(flags: Sequence[str], name: str, value: str) -> list[str]:
    """``flags`` with every ``--name`` dropped and ``--name value`` appended."""
    out: list[str] = []
    skip = False
    for i, flag in enumerate(flags):
        if skip:
            skip = False
            continue
        if flag == name:
            skip = i + 1 < len(flags)
            continue
        if flag.startswith(name + "="):
            continue
        out.append(flag)
    return out + [name, value]


def torchrun_command(nproc: int, flags: Sequence[str]) -> list[str]:
    """One host's torchrun of pretrain_llama.py on ``nproc`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc), str(PRETRAIN), *flags]


def supervise(flags: Sequence[str], max_restarts: int = DEFAULT_MAX_RESTARTS,
              launch: Callable[[list[str]], int] = subprocess.call,
              say: Callable[[str], None] = lambda line: print(line, flush=True)) -> int:
    """Run ``flags`` (pretrain_llama.py's) under torchrun and relaunch on the devices that are
    left after each lost peer, at most ``max_restarts`` times; returns the last run's exit
    status. UserError without ``--cluster`` or ``--save``."""
    cluster_path, save = flag_value(flags, "--cluster"), flag_value(flags, "--save")
    if cluster_path is None or save is None:
        raise UserError("tools/elastic_run.py needs --cluster (the devices to start on) and "
                        "--save (where checkpoints and the failure record go) among the "
                        "run's flags")
    flags = list(flags)
    cluster = ClusterSpec.load(cluster_path)
    restarts = 0
    while True:
        stale = Path(save) / FAILURE_FILE
        if stale.exists():
            stale.unlink()
        status = launch(torchrun_command(cluster.world_size, flags))
        failure = read_failure(save)
        if status == 0 or failure is None or not failure["lost_ranks"]:
            return status
        if restarts == max_restarts:
            say(f"elastic_run: ranks {failure['lost_ranks']} lost and no restart left "
                f"(--max-restarts {max_restarts}); exit status {status}")
            return status
        restarts += 1
        cluster = without_ranks(cluster, failure["lost_ranks"])
        path = Path(save) / "elastic" / f"cluster_{restarts}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_yaml(cluster.to_dict()))
        flags = with_flag(with_flag(flags, "--cluster", str(path)), "--plan", "auto")
        resume = _has_checkpoint(save)
        if resume:
            flags = with_flag(flags, "--load", save)
        say(f"elastic_run: iteration {failure['iteration']}: ranks {failure['lost_ranks']} "
            f"lost ({failure['line']}); restart {restarts} of {max_restarts} on the "
            f"{cluster.world_size} devices left ({path}), --plan auto"
            + (f", --load {save}" if resume else ", from the start"))


def _has_checkpoint(save: str) -> bool:
    from megatron_het.checkpoint.io import read_latest_iteration

    return read_latest_iteration(save) is not None


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def main(argv: Sequence[str]) -> int:
    """``[--max-restarts N] -- FLAGS``: :func:`supervise` FLAGS; the last run's status."""
    argv = list(argv)
    max_restarts = DEFAULT_MAX_RESTARTS
    if "--" not in argv:
        raise UserError("usage: tools/elastic_run.py [--max-restarts N] -- <pretrain_llama.py "
                        "flags>")
    split = argv.index("--")
    head, flags = argv[:split], argv[split + 1:]
    if head:
        if len(head) != 2 or head[0] != "--max-restarts" or not head[1].isdigit():
            raise UserError(f"unknown supervisor flags {' '.join(head)}; only "
                            "--max-restarts N goes before --")
        max_restarts = int(head[1])
    return supervise(flags, max_restarts)


__all__ = ["FAILURE_FILE", "flag_value", "main", "read_failure", "supervise",
           "torchrun_command", "with_flag", "write_failure"]
