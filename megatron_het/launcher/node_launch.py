"""The per-node launch of a mix: what ``scripts/<mix>/pretrain_llama_<size>.sh`` runs.

    python -m megatron_het.launcher scripts/<mix>/mix_<size>.yaml [flags] (launch_options.py)

:func:`plan_launch` turns a :class:`~megatron_het.launcher.launch_options.LaunchConfig` into a
:class:`Launch` without running anything: ``pretrain_llama.py --dry-run`` with the mix's
settings; in a Slurm batch step, the srun steps that start one node task per node
(:mod:`~megatron_het.launcher.slurm`); on a node (torchrun on every node, or a Slurm node
task), the node's environment (:mod:`~megatron_het.launcher.node_env`) and its torchrun agent,
or its elastic supervisor (``tools/elastic_run.py``) with ELASTIC=1. :func:`perform` prints a
launch (print-only: the environment changes and the commands) or runs it: one command replaces
this process, as a shell script's ``exec`` would; several Slurm steps run together.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from megatron_het.cluster import ClusterSpec
from megatron_het.errors import UserError
from megatron_het.launcher.launch_options import LaunchConfig, launch_config, parse_flags
from megatron_het.launcher.launch_usage import usage
from megatron_het.launcher.node_env import Source, changed, node_environment
from megatron_het.launcher.node_facts import NodeFacts, kind_runs, node_facts
from megatron_het.launcher.shell_env import source_shell_file
from megatron_het.launcher.slurm import (
    Runner,
    SlurmJob,
    check_gpus,
    fan_out,
    node_place,
    read_slurm_job,
    run_steps,
    step_commands,
)
from megatron_het.launcher.torchrun import TorchrunNode, node_torchrun

PRETRAIN = "pretrain_llama.py"
SUPERVISOR = "tools/elastic_run.py"


@dataclass(frozen=True)
class Launch:
    """What this node runs: ``commands`` (one: it replaces the launcher; several: Slurm steps
    run together, a failed one ending the others unless ``elastic``) in the environment
    ``env``, of which ``changes`` are the launcher's doing; ``note`` says what the node is."""

    commands: tuple[tuple[str, ...], ...]
    env: Mapping[str, str]
    changes: Mapping[str, str] = field(default_factory=dict)
    elastic: bool = False
    note: str = ""


def pretrain_flags(config: LaunchConfig, dry: bool) -> list[str]:
    """``pretrain_llama.py``'s flags for the mix (batch sizes come from the plan), then those
    given on the command line (the parser keeps a flag's last value, so they override).
    UserError when training lacks DATA_PATH or CHECKPOINT_DIR (a ``dry`` run uses mock data
    and writes nothing)."""
    mix, run = config.mix, config.run
    iters = str(run.train_iters)
    flags = [
        *("--model", mix.model, "--seq-length", str(mix.seq_length)),
        *("--cluster", run.cluster, "--plan", run.plan, "--bridge", run.bridge),
        *("--use-distributed-optimizer", "--bf16", "--train-iters", iters),
        *("--lr", f"{mix.lr:g}", "--min-lr", f"{mix.min_lr:g}", "--lr-decay-style", "cosine"),
        *("--lr-warmup-iters", str(run.lr_warmup_iters), "--lr-decay-iters", iters),
        *("--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95"),
        *("--adam-eps", "1e-8", "--clip-grad", "1.0", "--eval-interval", "1000"),
        *("--eval-iters", "10", "--seed", str(run.seed)),
    ]
    if run.data_path:
        flags += ["--data-path", *run.data_path, "--split", run.split]
    elif dry:
        flags += ["--mock-data"]
    else:
        raise UserError(
            "DATA_PATH is not set; export DATA_PATH=/path/to/prefix_text_document (or "
            "DRY_RUN=1 to validate without data)"
        )
    if run.tokenizer_model:
        flags += ["--tokenizer-type", "SentencePieceTokenizer"]
        flags += ["--tokenizer-model", run.tokenizer_model]
    else:
        flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(run.null_vocab_size)]
    if run.checkpoint_dir:
        flags += ["--save", run.checkpoint_dir, "--load", run.checkpoint_dir]
        flags += ["--save-interval", str(run.save_interval)]
    elif not dry:
        raise UserError("CHECKPOINT_DIR is not set; export CHECKPOINT_DIR=/path/to/checkpoints")
    if run.log_dir and not dry:
        flags += ["--log-interval", "1", "--metrics-file", f"{run.log_dir}/metrics.jsonl"]
        flags += ["--tensorboard-dir", run.tensorboard_dir]
    return [*flags, *config.extra]


def plan_launch(
    config: LaunchConfig,
    repo: Path,
    environ: Mapping[str, str],
    hostname: str,
    run: Runner = subprocess.run,
    source: Source = source_shell_file,
) -> Launch:
    """What ``config`` runs on this host (module docstring): ``repo`` is the repository root
    (the cluster and plan paths start there), ``environ`` this process's environment,
    ``hostname`` this host's name; ``run`` runs ``scontrol`` and ``source`` sources a shell
    file (:func:`~megatron_het.launcher.shell_env.source_shell_file`). Nothing is started.
    UserError (one line) for anything the user can fix."""
    paths = config.run
    if not (repo / paths.cluster).is_file():
        raise UserError(f"cluster file {paths.cluster} not found; set CLUSTER to an existing YAML")
    if not (repo / paths.plan).is_file():
        raise UserError(
            f"plan file {paths.plan} not found; set PLAN or write one with tools/plan.py --out"
        )
    if config.dry_run:
        flags = pretrain_flags(config, dry=True)
        return Launch(((config.python, PRETRAIN, *flags, "--dry-run"),), environ)
    flags = pretrain_flags(config, dry=False)
    cluster = ClusterSpec.load(repo / paths.cluster)
    slurm = config.launcher == "slurm"
    job = read_slurm_job(environ, hostname.split(".")[0]) if slurm else None
    node_rank, master_addr = config.node.node_rank, config.node.master_addr
    if job is not None and not config.node.slurm_node:
        return _fan_out(config, repo, cluster, job, environ, run)
    if job is not None:
        node_rank, master_addr = node_place(job, config.node.node_order, master_addr, run)
    if node_rank is None:
        raise UserError(
            f"NODE_RANK is not set; export NODE_RANK=<this node's index in {paths.cluster}> "
            "on every node"
        )
    if not master_addr:
        raise UserError("MASTER_ADDR is not set; export MASTER_ADDR=<hostname of node 0>")
    facts = node_facts(cluster, node_rank)
    env = node_environment(facts, environ, source)
    if job is not None:
        check_gpus(job, node_rank, facts.gpus)
    place = TorchrunNode(facts.nnodes, node_rank, facts.nproc, master_addr, config.node.master_port)
    if config.node.elastic:
        command = _supervisor(config, place, config.node.node_addr or hostname, flags)
    else:
        command = node_torchrun(config.python, place, PRETRAIN, flags)
    return Launch((tuple(command),), env, changed(environ, env), note=_note(config, facts, place))


def _fan_out(
    config: LaunchConfig,
    repo: Path,
    cluster: ClusterSpec,
    job: SlurmJob,
    environ: Mapping[str, str],
    run: Runner,
) -> Launch:
    """The Slurm batch step's launch: its srun steps, each task the mix's script again as a
    node task, and the node order the tasks take their place in (exported where it came from
    the heterogeneous job's components)."""
    name = Path(config.run.cluster).name
    node_order = config.node.node_order
    fan = fan_out(job, cluster.num_nodes, kind_runs(cluster), node_order, name, run)
    task = ["bash", str(repo / config.mix.script), *config.args]
    commands = step_commands(fan, config.node.elastic, task)
    env = dict(environ)
    if fan.node_order != node_order:
        env["NODE_ORDER"] = fan.node_order
    return Launch(
        tuple(tuple(c) for c in commands), env, changed(environ, env), config.node.elastic
    )


def _supervisor(
    config: LaunchConfig, place: TorchrunNode, node_addr: str, flags: list[str]
) -> list[str]:
    """This node's elastic supervisor of the run (one per node; its torchrun has the same
    static rendezvous, see :mod:`~megatron_het.launcher.torchrun`)."""
    return [
        *(config.python, SUPERVISOR, "--max-restarts", str(config.node.max_restarts)),
        *("--node-rank", str(place.node_rank), "--master-addr", place.master_addr),
        *("--master-port", str(place.master_port), "--node-addr", node_addr),
        "--",
        *flags,
    ]


def _note(config: LaunchConfig, facts: NodeFacts, place: TorchrunNode) -> str:
    return (
        f"[launch] {config.mix.name} node {place.node_rank}/{facts.nnodes}: {facts.nproc} x "
        f"{' '.join(facts.accelerators)} (ranks {facts.first_rank}..{facts.last_rank} of "
        f"{facts.world_size})"
    )


def perform(launch: Launch, print_only: bool, cwd: Path, out: TextIO = sys.stdout) -> int:
    """Run ``launch`` in ``cwd``, or with ``print_only`` print it to ``out`` (one ``export``
    line per environment change, one ``+`` line per command) and run nothing. One command
    replaces this process; several run as Slurm steps (:func:`~megatron_het.launcher.slurm.
    run_steps`), whose status is returned."""
    if launch.note:
        print(launch.note, file=sys.stderr, flush=True)
    if print_only:
        for name, value in launch.changes.items():
            print(f"export {name}={shlex.quote(value)}", file=out)
        for command in launch.commands:
            print(f"+ {shlex.join(command)}", file=out)
        out.flush()
        return 0
    if len(launch.commands) > 1:
        return run_steps(launch.commands, launch.env, launch.elastic, str(cwd))
    command = launch.commands[0]
    sys.stdout.flush()
    os.chdir(cwd)
    os.execvpe(command[0], list(command), dict(launch.env))


def main(
    argv: list[str], environ: Mapping[str, str], repo: Path, python: str, hostname: str
) -> int:
    """``python -m megatron_het.launcher MIX_FILE ARGS``: ``--help``, or plan the launch of
    this host and perform it (module docstring); the exit status where nothing replaced this
    process."""
    flags = parse_flags(argv)
    if flags.show_help:
        print(usage(flags.mix, repo, argv[0]))
        return 0
    config = launch_config(flags, environ, python)
    return perform(plan_launch(config, repo, environ, hostname), config.print_only, repo)
