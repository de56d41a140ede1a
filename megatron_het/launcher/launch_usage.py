"""``scripts/<mix>/pretrain_llama_<size>.sh --help``: the mix's own lines, then the usage."""

from __future__ import annotations

from pathlib import Path

from megatron_het.launcher.mix import MixSettings

_USAGE = """
Usage:
  DRY_RUN=1 {script}      # validate plan, cluster, model and batch here
  # on every node (torchrun):
  NODE_RANK=<n> MASTER_ADDR=<node 0> DATA_PATH=... TOKENIZER_MODEL=... CHECKPOINT_DIR=... \\
      {script}
  # Slurm ({nodes} nodes; from the repository root):
  LAUNCHER=slurm NODE_ORDER="<hosts in the cluster file's order>" DATA_PATH=... \\
      TOKENIZER_MODEL=... CHECKPOINT_DIR=... sbatch {script}
  # Slurm heterogeneous job: one component per node group, in the cluster file's order,
  # each with its own device request; its hosts in that order are the node order:
  LAUNCHER=slurm DATA_PATH=... CHECKPOINT_DIR=... sbatch \\
      --nodes=<n0> --exclusive --ntasks-per-node=1 <devices> \\
      : --nodes=<n1> --exclusive --ntasks-per-node=1 <devices> {script}

Flags (or variables):
  --dry-run (DRY_RUN=1)          pretrain_llama.py --dry-run with the mix's settings
  --launcher torchrun|slurm (LAUNCHER)  torchrun: start the script on every node with NODE_RANK;
                                 slurm: inside sbatch/salloc, srun starts one torchrun per node
                                 (one srun step per component of a heterogeneous job)
  --print-only (PRINT_ONLY=1)    print the node's environment changes and the command, run nothing
  ELASTIC=1                      one supervisor per node (tools/elastic_run.py) instead of
                                 torchrun: after a lost peer every node relaunches on the devices
                                 left with --plan auto (MAX_RESTARTS, default 3; NODE_ADDR, this
                                 node's address for the others, default its hostname); under
                                 Slurm submit with sbatch --no-kill, so a lost node does not end
                                 the job
  other arguments (and all after --) go to pretrain_llama.py (e.g. --train-iters 10)

Variables:
  DATA_PATH        dataset prefix(es) (PREFIX.bin/.idx, or "W1 P1 W2 P2" to blend); required for
                   training, a dry run without it uses --mock-data
  TOKENIZER_MODEL  SentencePiece model; without it NullTokenizer over pre-tokenized ids
  NULL_VOCAB_SIZE  NullTokenizer --vocab-size (default {null_vocab}: the model's vocabulary
                   minus its eod id)
  CHECKPOINT_DIR   --save/--load directory (resumes from its latest checkpoint) on a filesystem
                   every node mounts at the same path (checked at start-up); required for
                   training; SAVE_INTERVAL (default 500)
  LOG_DIR          metrics.jsonl and tensorboard/ (default $CHECKPOINT_DIR/logs);
                   TENSORBOARD_DIR overrides $LOG_DIR/tensorboard
  MASTER_ADDR, MASTER_PORT  rendezvous host (node 0) and port (default 29500)
  NODE_RANK        this node's index in the cluster file's node order (node 0: the first node
                   of its first node group)
  NODE_ORDER       Slurm: the allocation's hosts in the cluster file's node order ("a1 a2 m1",
                   "a1,a2,m1" or "a[1-2],m1"); each node task takes its place in it as NODE_RANK
                   and its first host as MASTER_ADDR. Without it Slurm's node order is used
                   (a heterogeneous job's: its components' hosts in order), and a job whose
                   nodes come in another order stops at start-up (each rank checks its device
                   against the kind the cluster file gives it)
  CLUSTER, PLAN    override {cluster} / {plan}
  BRIDGE           relay | direct (default {bridge})
  TRAIN_ITERS, LR_WARMUP_ITERS, SEED, SPLIT   run length, warm-up, seed, data split
  PYTHON           interpreter (default: the repository's .venv, else python3)
  HET_SOCKET_IFNAME, HET_IB_HCA  site network interface (gloo, NCCL and HCCL bind to it; needed
                   where a node's hostname resolves to a loopback address such as 127.0.1.1)
                   and IB/RoCE adapters
  HET_EXTRA_ENV    a shell file sourced last on every node (another vendor's variables, site
                   tweaks): what it exports reaches the ranks
The mix's settings: {settings} (keys in docs/launching.md)."""


def usage(mix: MixSettings, repo: Path, settings: str) -> str:
    """The help text of ``mix``'s script (in ``repo``; ``settings``: its settings file): the
    script's own comment lines up to its ``#SBATCH`` lines (what the mix is), then the usage,
    flags and variables."""
    lines = (repo / mix.script).read_text().splitlines()
    sbatch = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")] or [len(lines)]
    own = [
        line[2:] if line.startswith("# ") else line[1:]
        for line in lines[1 : sbatch[0]]
        if line.startswith("#") and not line.startswith("# Modes, flags")
    ]
    nodes = "?"
    for line in lines:
        if line.startswith("#SBATCH --nodes="):
            nodes = line.removeprefix("#SBATCH --nodes=")
    return (
        "\n".join(own)
        + "\n"
        + _USAGE.format(
            script=mix.script,
            nodes=nodes,
            null_vocab=mix.null_vocab_size,
            cluster=mix.cluster,
            plan=mix.plan,
            bridge=mix.bridge,
            settings=settings,
        )
    )
