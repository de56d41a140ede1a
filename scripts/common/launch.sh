# Shared launch logic of scripts/<mix>/pretrain_llama_<size>.sh (sourced, not run directly).
#
# A mix script sets HET_MIX, HET_SIZE, HET_MODEL, HET_SEQ_LENGTH, HET_NULL_VOCAB (the
# NullTokenizer --vocab-size whose padded vocabulary is the model's), HET_BRIDGE, HET_TRAIN_ARGS
# (an array of Megatron-style hyperparameter flags), then calls `het_main "$@"`.
#
# Modes (flag or environment variable):
#   --dry-run            | DRY_RUN=1       validate plan + cluster + model + batch on this machine
#                                          (python pretrain_llama.py ... --dry-run), no processes
#   --launcher torchrun  | LAUNCHER=torchrun  (default) run this node's ranks with torchrun; start
#                                          the script once on every node with NODE_RANK set
#   --launcher slurm     | LAUNCHER=slurm  inside sbatch/salloc: srun starts one torchrun per node
#   --print-only         | PRINT_ONLY=1    print the node's environment and the command, run nothing
# Any other argument is passed on to pretrain_llama.py (e.g. --train-iters 10).
#
# Environment (placeholders a site fills in):
#   DATA_PATH        dataset prefix(es) (PREFIX.bin/.idx, or "W1 P1 W2 P2" to blend); required
#                    for training, a dry run without it uses --mock-data
#   TOKENIZER_MODEL  SentencePiece model; without it NullTokenizer over pre-tokenized ids
#   NULL_VOCAB_SIZE  NullTokenizer --vocab-size (default: the model's vocabulary minus its eod id)
#   CHECKPOINT_DIR   --save/--load directory (resumes from its latest checkpoint); required for
#                    training
#   LOG_DIR          metrics.jsonl and tensorboard/ (default $CHECKPOINT_DIR/logs)
#   TENSORBOARD_DIR  overrides $LOG_DIR/tensorboard
#   MASTER_ADDR, MASTER_PORT  rendezvous host (node 0) and port (default 29500)
#   NODE_RANK        this node's index in the cluster file's node order (torchrun launcher)
#   CLUSTER, PLAN    override the mix's cluster YAML / plan JSON
#   BRIDGE           relay | direct (default: the mix's)
#   PYTHON           interpreter (default: the repository's .venv, else python3)
#   HET_SOCKET_IFNAME, HET_IB_HCA, HET_EXTRA_ENV   site network / extra settings (vendor_env.sh)

# The repository root: next to this file, or (a copy run by sbatch) the submission directory.
het_repo_root() {
    local here
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    if [ -f "$here/pretrain_llama.py" ]; then
        printf '%s' "$here"
    elif [ -n "${SLURM_SUBMIT_DIR:-}" ] && [ -f "$SLURM_SUBMIT_DIR/pretrain_llama.py" ]; then
        printf '%s' "$SLURM_SUBMIT_DIR"
    else
        echo "error: cannot find the repository root; run the script from its checkout or sbatch it from the repository root" >&2
        return 2
    fi
}

het_die() {
    echo "error: $*" >&2
    exit 2
}

het_usage() {
    sed -n '2,/^set -euo/p' "$HET_REPO/scripts/$HET_MIX/pretrain_llama_$HET_SIZE.sh" \
        | grep '^#' | grep -v '^#!' | grep -v '^#SBATCH' | sed 's/^# \{0,1\}//'
}

# Parse the script's own flags into DRY_RUN/LAUNCHER/PRINT_ONLY; the rest goes to HET_EXTRA.
het_parse_flags() {
    HET_EXTRA=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --dry-run) DRY_RUN=1 ;;
            --print-only) PRINT_ONLY=1 ;;
            --launcher) [ $# -ge 2 ] || het_die "--launcher needs torchrun or slurm"
                        LAUNCHER="$2"; shift ;;
            --launcher=*) LAUNCHER="${1#--launcher=}" ;;
            -h|--help) het_usage; exit 0 ;;
            --) shift; HET_EXTRA+=("$@"); break ;;
            *) HET_EXTRA+=("$1") ;;
        esac
        shift
    done
    case "${LAUNCHER:=torchrun}" in
        torchrun|slurm) ;;
        *) het_die "LAUNCHER must be torchrun or slurm, got '$LAUNCHER'" ;;
    esac
}

# The pretrain_llama.py arguments of this run, into HET_ARGS.
het_build_args() {
    local dry="$1"
    HET_ARGS=(pretrain_llama.py --model "$HET_MODEL" --seq-length "$HET_SEQ_LENGTH"
              --cluster "$CLUSTER" --plan "$PLAN" --bridge "$BRIDGE"
              --use-distributed-optimizer --bf16 "${HET_TRAIN_ARGS[@]}")
    if [ -n "${DATA_PATH:-}" ]; then
        local -a prefixes
        read -r -a prefixes <<< "$DATA_PATH"
        HET_ARGS+=(--data-path "${prefixes[@]}" --split "${SPLIT:-99,1,0}")
    elif [ "$dry" = 1 ]; then
        HET_ARGS+=(--mock-data)
    else
        het_die "DATA_PATH is not set; export DATA_PATH=/path/to/prefix_text_document (or DRY_RUN=1 to validate without data)"
    fi
    if [ -n "${TOKENIZER_MODEL:-}" ]; then
        HET_ARGS+=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
    else
        HET_ARGS+=(--tokenizer-type NullTokenizer --vocab-size "${NULL_VOCAB_SIZE:-$HET_NULL_VOCAB}")
    fi
    if [ -n "${CHECKPOINT_DIR:-}" ]; then
        HET_ARGS+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR"
                   --save-interval "${SAVE_INTERVAL:-500}")
    elif [ "$dry" != 1 ]; then
        het_die "CHECKPOINT_DIR is not set; export CHECKPOINT_DIR=/path/to/checkpoints"
    fi
    local log_dir="${LOG_DIR:-${CHECKPOINT_DIR:+$CHECKPOINT_DIR/logs}}"
    if [ -n "$log_dir" ] && [ "$dry" != 1 ]; then
        HET_ARGS+=(--log-interval 1 --metrics-file "$log_dir/metrics.jsonl"
                   --tensorboard-dir "${TENSORBOARD_DIR:-$log_dir/tensorboard}")
    fi
    HET_ARGS+=("${HET_EXTRA[@]}")
}

# Export the environment of node NODE_RANK (its vendors' settings) and set the HET_NODE_* facts.
het_node_env() {
    local node_rank="$1" facts
    facts="$("$PYTHON" "$HET_REPO/scripts/common/node_info.py" --cluster "$CLUSTER" \
             --node-rank "$node_rank")" || exit 2
    eval "$facts"
    het_env_common
    local vendor
    for vendor in $HET_NODE_VENDORS; do
        het_vendor_env "$vendor" "$HET_NODE_NPROC" || exit 2
    done
    if [ -n "${HET_EXTRA_ENV:-}" ]; then
        # shellcheck disable=SC1090
        source "$HET_EXTRA_ENV"
    fi
}

# Run (or, with PRINT_ONLY=1, print) a command, listing the variables this script exported.
het_exec() {
    if [ "${PRINT_ONLY:-0}" = 1 ]; then
        comm -13 <(printf '%s\n' "$HET_ENV_BEFORE") <(export -p | sort)
        printf '+'; printf ' %q' "$@"; printf '\n'
        exit 0
    fi
    exec "$@"
}

# Slurm, in the batch step: one task per node, each re-entering this script as a node task.
het_slurm_fanout() {
    [ -n "${SLURM_JOB_ID:-}" ] || het_die "LAUNCHER=slurm needs a Slurm allocation; submit with sbatch or run inside salloc"
    local facts
    facts="$("$PYTHON" "$HET_REPO/scripts/common/node_info.py" --cluster "$CLUSTER" --node-rank 0)" || exit 2
    eval "$facts"
    if [ -n "${SLURM_JOB_NUM_NODES:-}" ] && [ "$SLURM_JOB_NUM_NODES" != "$HET_NNODES" ]; then
        het_die "the allocation has $SLURM_JOB_NUM_NODES nodes but cluster $(basename "$CLUSTER") needs $HET_NNODES; use sbatch --nodes=$HET_NNODES"
    fi
    het_exec srun --nodes="$HET_NNODES" --ntasks="$HET_NNODES" --ntasks-per-node=1 \
        --kill-on-bad-exit=1 --export=ALL,HET_SLURM_NODE=1 \
        bash "$HET_REPO/scripts/$HET_MIX/pretrain_llama_$HET_SIZE.sh" "$@"
}

het_main() {
    HET_ENV_BEFORE="$(export -p | sort)"
    HET_REPO="$(het_repo_root)" || exit 2
    cd "$HET_REPO"
    het_parse_flags "$@"
    CLUSTER="${CLUSTER:-scripts/clusters/$HET_MIX.yaml}"
    PLAN="${PLAN:-scripts/$HET_MIX/plan_$HET_SIZE.json}"
    BRIDGE="${BRIDGE:-$HET_BRIDGE}"
    if [ -z "${PYTHON:-}" ]; then
        if [ -x "$HET_REPO/.venv/bin/python" ]; then PYTHON="$HET_REPO/.venv/bin/python"; else PYTHON=python3; fi
    fi
    [ -f "$CLUSTER" ] || het_die "cluster file $CLUSTER not found; set CLUSTER to an existing YAML"
    [ -f "$PLAN" ] || het_die "plan file $PLAN not found; set PLAN or write one with tools/plan.py --out"
    if [ "${DRY_RUN:-0}" = 1 ]; then
        het_build_args 1
        het_exec "$PYTHON" "${HET_ARGS[@]}" --dry-run
    fi
    het_build_args 0
    if [ "$LAUNCHER" = slurm ] && [ -z "${HET_SLURM_NODE:-}" ]; then
        het_slurm_fanout "$@"
    fi
    if [ "$LAUNCHER" = slurm ]; then
        NODE_RANK="${SLURM_NODEID:?SLURM_NODEID is not set; srun starts the node tasks}"
        if [ -z "${MASTER_ADDR:-}" ]; then
            MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
        fi
    fi
    [ -n "${NODE_RANK:-}" ] || het_die "NODE_RANK is not set; export NODE_RANK=<this node's index in $CLUSTER> on every node"
    [ -n "${MASTER_ADDR:-}" ] || het_die "MASTER_ADDR is not set; export MASTER_ADDR=<hostname of node 0>"
    het_node_env "$NODE_RANK"
    echo "[launch] $HET_MIX node $NODE_RANK/$HET_NNODES: $HET_NODE_NPROC x $HET_NODE_ACCELERATORS" \
         "(ranks $HET_NODE_FIRST_RANK..$((HET_NODE_FIRST_RANK + HET_NODE_NPROC - 1)) of $HET_WORLD_SIZE)" >&2
    het_exec "$PYTHON" -m torch.distributed.run --nnodes "$HET_NNODES" \
        --nproc_per_node "$HET_NODE_NPROC" --node_rank "$NODE_RANK" \
        --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" "${HET_ARGS[@]}"
}
