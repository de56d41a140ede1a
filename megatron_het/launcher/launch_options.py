"""The per-node launch's flags and variables -> one frozen :class:`LaunchConfig`, read once.

    python -m megatron_het.launcher scripts/<mix>/mix_<size>.yaml [--dry-run] [--print-only]
        [--launcher torchrun|slurm] [-h] [pretrain_llama.py flags] [-- pretrain_llama.py flags]

Flags go through argparse; the launcher's flags and variables (DRY_RUN, LAUNCHER, ...; the
table is in :mod:`~megatron_het.launcher.launch_usage` and docs/launching.md) through a small
reader whose mistakes are one-line UserErrors. A flag outranks its variable. Variables set to
the empty string count as unset, as a shell's ``${NAME:-default}`` reads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_het.arguments.parser import ArgParser
from megatron_het.errors import UserError
from megatron_het.launcher.mix import MixSettings, load_mix

LAUNCHERS = ("torchrun", "slurm")
DEFAULT_TRAIN_ITERS = 500_000
DEFAULT_MASTER_PORT = 29500
DEFAULT_MAX_RESTARTS = 3


@dataclass(frozen=True)
class RunVariables:
    """What shapes the run's ``pretrain_llama.py`` command: the data (``data_path``: prefixes,
    or weights and prefixes to blend), tokenizer, checkpoint and log directories, the cluster,
    plan and bridge (the mix's unless overridden), run length, warm-up, seed and data split."""

    data_path: tuple[str, ...]
    tokenizer_model: str
    null_vocab_size: int
    checkpoint_dir: str
    save_interval: int
    log_dir: str
    tensorboard_dir: str
    cluster: str
    plan: str
    bridge: str
    train_iters: int
    lr_warmup_iters: int
    seed: int
    split: str


@dataclass(frozen=True)
class NodeVariables:
    """This node's place: ``node_rank`` (None: not given), the rendezvous host and port, the
    Slurm node order as given (""), ``elastic`` (one supervisor per node, at most
    ``max_restarts`` relaunches, reached at ``node_addr``; "": the host's name) and
    ``slurm_node`` (this process is a node task of the Slurm fan-out)."""

    node_rank: int | None
    master_addr: str
    master_port: int
    node_order: str
    elastic: bool
    max_restarts: int
    node_addr: str
    slurm_node: bool


@dataclass(frozen=True)
class LaunchFlags:
    """The script's command line: the mix, its arguments as given (``args``; a Slurm node task
    gets them again), ``pretrain_llama.py``'s flags among them (``extra``) and the launcher's
    own (``launcher``: None where the flag is absent)."""

    mix: MixSettings
    args: tuple[str, ...]
    extra: tuple[str, ...]
    dry_run: bool
    print_only: bool
    launcher: str | None
    show_help: bool


@dataclass(frozen=True)
class LaunchConfig:
    """One launch: the mix, ``pretrain_llama.py``'s flags given on the command line
    (``extra``), the modes (flag or variable), the run's and the node's variables, and the
    interpreter every command runs under."""

    mix: MixSettings
    args: tuple[str, ...]
    extra: tuple[str, ...]
    dry_run: bool
    print_only: bool
    launcher: str
    run: RunVariables
    node: NodeVariables
    python: str


class _Variables:
    """Reads launch variables from an environment; empty means unset."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ

    def text(self, name: str, default: str = "") -> str:
        return self._environ.get(name) or default

    def on(self, name: str) -> bool:
        return self._environ.get(name) == "1"

    def integer(self, name: str, default: int, minimum: int = 0) -> int:
        text = self._environ.get(name)
        if not text:
            return default
        if not text.isdigit() or int(text) < minimum:
            raise UserError(f"{name} must be an integer of at least {minimum}, got '{text}'")
        return int(text)

    def optional_integer(self, name: str) -> int | None:
        return self.integer(name, -1) if self._environ.get(name) else None


def _parser(prog: str) -> ArgParser:
    p = ArgParser(prog=prog, add_help=False, allow_abbrev=False)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--print-only", action="store_true")
    p.add_argument("--launcher")
    p.add_argument("-h", "--help", action="store_true")
    return p


def parse_flags(argv: Sequence[str]) -> LaunchFlags:
    """``argv``: the mix file, then the script's arguments. UserError (one line) for a bad
    mix file or flag."""
    if not argv or argv[0].startswith("-"):
        raise UserError(
            "usage: python -m megatron_het.launcher scripts/<mix>/mix_<size>.yaml [flags]; "
            "or run scripts/<mix>/pretrain_llama_<size>.sh --help"
        )
    mix = load_mix(argv[0])
    args = tuple(argv[1:])
    # After "--" every argument is pretrain_llama.py's, whatever it looks like.
    split = args.index("--") if "--" in args else len(args)
    flags, extra = _parser(mix.script).parse_known_args(list(args[:split]))
    return LaunchFlags(
        mix=mix,
        args=args,
        extra=(*extra, *args[split + 1 :]),
        dry_run=flags.dry_run,
        print_only=flags.print_only,
        launcher=flags.launcher,
        show_help=flags.help,
    )


def launch_config(flags: LaunchFlags, environ: Mapping[str, str], python: str) -> LaunchConfig:
    """``flags`` with the launch variables of ``environ``; ``python``: the interpreter for
    every command. UserError (one line) for a bad variable."""
    variables = _Variables(environ)
    launcher = flags.launcher or variables.text("LAUNCHER", "torchrun")
    if launcher not in LAUNCHERS:
        raise UserError(f"LAUNCHER must be torchrun or slurm, got '{launcher}'")
    return LaunchConfig(
        mix=flags.mix,
        args=flags.args,
        extra=flags.extra,
        dry_run=flags.dry_run or variables.on("DRY_RUN"),
        print_only=flags.print_only or variables.on("PRINT_ONLY"),
        launcher=launcher,
        run=_run_variables(variables, flags.mix),
        node=_node_variables(variables),
        python=python,
    )


def _run_variables(variables: _Variables, mix: MixSettings) -> RunVariables:
    checkpoint_dir = variables.text("CHECKPOINT_DIR")
    log_dir = variables.text("LOG_DIR", f"{checkpoint_dir}/logs" if checkpoint_dir else "")
    return RunVariables(
        data_path=tuple(variables.text("DATA_PATH").split()),
        tokenizer_model=variables.text("TOKENIZER_MODEL"),
        null_vocab_size=variables.integer("NULL_VOCAB_SIZE", mix.null_vocab_size, minimum=1),
        checkpoint_dir=checkpoint_dir,
        save_interval=variables.integer("SAVE_INTERVAL", 500, minimum=1),
        log_dir=log_dir,
        tensorboard_dir=variables.text("TENSORBOARD_DIR", f"{log_dir}/tensorboard"),
        cluster=variables.text("CLUSTER", mix.cluster),
        plan=variables.text("PLAN", mix.plan),
        bridge=variables.text("BRIDGE", mix.bridge),
        train_iters=variables.integer("TRAIN_ITERS", DEFAULT_TRAIN_ITERS, minimum=1),
        lr_warmup_iters=variables.integer("LR_WARMUP_ITERS", mix.warmup_iters),
        seed=variables.integer("SEED", 1234),
        split=variables.text("SPLIT", "99,1,0"),
    )


def _node_variables(variables: _Variables) -> NodeVariables:
    return NodeVariables(
        node_rank=variables.optional_integer("NODE_RANK"),
        master_addr=variables.text("MASTER_ADDR"),
        master_port=variables.integer("MASTER_PORT", DEFAULT_MASTER_PORT, minimum=1),
        node_order=variables.text("NODE_ORDER"),
        elastic=variables.on("ELASTIC"),
        max_restarts=variables.integer("MAX_RESTARTS", DEFAULT_MAX_RESTARTS),
        node_addr=variables.text("NODE_ADDR"),
        slurm_node=bool(variables.text("HET_SLURM_NODE")),
    )
