# The shared body of every launch script (sourced by scripts/<mix>/pretrain_llama_<size>.sh, not
# run directly): flags and modes, per-vendor node environment, the pretrain_llama.py command line,
# and torchrun or Slurm. `<script> --help` prints the usage (het_usage below).
#
# A mix script is its settings and two lines: it sets
#   HET_MIX, HET_SIZE      the mix's name and model size (the script is scripts/$HET_MIX/
#                          pretrain_llama_$HET_SIZE.sh; Slurm's node tasks re-enter it)
#   HET_CLUSTER, HET_PLAN  its cluster YAML and plan JSON (paths from the repository root)
#   HET_MODEL, HET_SEQ_LENGTH
#   HET_NULL_VOCAB         NullTokenizer --vocab-size whose vocabulary (+ eod) is the model's
#   HET_BRIDGE             relay | direct
#   HET_LR, HET_MIN_LR, HET_WARMUP_ITERS   its learning-rate schedule
# then sources this file and calls `het_main "$@"`.
#
# The node settings below use ${VAR:-default}: a site sets its own value by exporting the
# variable before calling the script, and --print-only lists only what the script changed.

# ---- per-vendor node environment -------------------------------------------------------------

# The first NPROC device indices, comma separated: 0,1,...,NPROC-1.
het_device_list() {
    local n="$1" i list=""
    for ((i = 0; i < n; i++)); do list+="${list:+,}$i"; done
    printf '%s' "$list"
}

# Settings every node needs whatever its vendor.
het_env_common() {
    # The relay bridge between kinds stages through host memory and gloo over TCP: pin gloo to
    # the fast host interface when the site names one.
    if [ -n "${HET_SOCKET_IFNAME:-}" ]; then
        export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$HET_SOCKET_IFNAME}"
    fi
    # One OpenMP thread per rank for host-side work (data loading, relay copies): the
    # accelerator does the math, and oversubscribed host threads only add jitter.
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
}

# NCCL's (and RCCL's, which reads the same names) site network: bootstrap interface, IB adapters.
het_env_nccl_network() {
    if [ -n "${HET_SOCKET_IFNAME:-}" ]; then
        export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$HET_SOCKET_IFNAME}"
    fi
    if [ -n "${HET_IB_HCA:-}" ]; then
        export NCCL_IB_HCA="${NCCL_IB_HCA:-$HET_IB_HCA}"
    fi
}

# NVIDIA GPUs: torch's nccl backend runs NCCL.
het_env_nvidia() {
    # One hardware work queue, so a tensor-parallel collective is issued before the compute that
    # follows it (Megatron's ordering assumption for overlapping TP communication).
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    # Expose exactly this node's GPUs for its ranks; its i-th GPU rank drives GPU i.
    export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-$(het_device_list "$1")}"
    # A failed or hung collective aborts the process (and the job) instead of hanging forever.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    # Longer InfiniBand retry timeout (4.096 us * 2^22): large fabrics see transient stalls.
    export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
    # Warnings only; set NCCL_DEBUG=INFO to see the rings/trees NCCL builds.
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    het_env_nccl_network
}

# AMD Instinct GPUs (ROCm): torch's nccl backend runs RCCL.
het_env_amd() {
    # Expose exactly this node's GPUs for its ranks (GCDs on MI250X); its i-th GPU rank drives
    # device i.
    export HIP_VISIBLE_DEVICES="${HIP_VISIBLE_DEVICES:-$(het_device_list "$1")}"
    # Same ordering assumption as on NVIDIA (ROCm's torch honours the CUDA name).
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    # Fine-grained host memory over PCIe, which RCCL's peer-to-peer and network paths need.
    export HSA_FORCE_FINE_GRAIN_PCIE="${HSA_FORCE_FINE_GRAIN_PCIE:-1}"
    # Keep scratch memory allocated between kernels: reclaiming it stalls long training runs.
    export HSA_NO_SCRATCH_RECLAIM="${HSA_NO_SCRATCH_RECLAIM:-1}"
    # RoCE v2 fabrics usually expose the routable (IPv4-mapped) GID at index 3.
    export NCCL_IB_GID_INDEX="${NCCL_IB_GID_INDEX:-3}"
    # Abort on a failed collective instead of hanging (RCCL through torch's nccl backend).
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    het_env_nccl_network
}

# Huawei Ascend NPUs: torch_npu's hccl backend runs HCCL.
het_env_huawei() {
    # The CANN toolkit's own environment (library paths, ASCEND_HOME_PATH, ...). Its script is
    # not written for `set -u`, so relax that while it runs.
    local cann_env="${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit/latest}/../set_env.sh"
    if [ -f "$cann_env" ]; then
        set +u
        # shellcheck disable=SC1090
        source "$cann_env"
        set -u
    fi
    # Expose exactly this node's NPUs for its ranks; its i-th NPU rank drives NPU i.
    export ASCEND_RT_VISIBLE_DEVICES="${ASCEND_RT_VISIBLE_DEVICES:-$(het_device_list "$1")}"
    # Seconds HCCL waits for every rank to join a communicator: hundreds of ranks need minutes.
    export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1200}"
    # Seconds a collective may block before HCCL reports it as hung.
    export HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-1800}"
    # Per-communicator buffer in MB: room for the large DP gradient buckets.
    export HCCL_BUFFSIZE="${HCCL_BUFFSIZE:-200}"
    # CANN logs errors only (0 debug .. 3 error); plog files otherwise grow quickly.
    export ASCEND_GLOBAL_LOG_LEVEL="${ASCEND_GLOBAL_LOG_LEVEL:-3}"
    # torch_npu's asynchronous task queue: launches overlap host-side operator dispatch.
    export TASK_QUEUE_ENABLE="${TASK_QUEUE_ENABLE:-1}"
    # Expandable allocator segments: less fragmentation with changing activation sizes.
    export PYTORCH_NPU_ALLOC_CONF="${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}"
    if [ -n "${HET_SOCKET_IFNAME:-}" ]; then
        export HCCL_SOCKET_IFNAME="${HCCL_SOCKET_IFNAME:-$HET_SOCKET_IFNAME}"
    fi
}

# Export the settings of VENDOR (the cluster files' names) for a node whose NPROC ranks drive
# that vendor's devices.
# Another vendor's accelerators get nothing beyond the abort-on-failure setting: put the
# vendor's own variables in the file named by HET_EXTRA_ENV. CPU ranks (plain or emulated
# kinds) run gloo only.
het_vendor_env() {
    local vendor="$1" nproc="$2"
    case "$vendor" in
        nvidia) het_env_nvidia "$nproc" ;;
        amd) het_env_amd "$nproc" ;;
        huawei) het_env_huawei "$nproc" ;;
        other) export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}" ;;
        cpu) ;;
        *) echo "error: unknown vendor '$vendor' in the cluster file; use nvidia, amd, huawei, cpu or other" >&2
           return 2 ;;
    esac
}

# ---- command line and launch -----------------------------------------------------------------

het_die() {
    echo "error: $*" >&2
    exit 2
}

het_usage() {
    local script="scripts/$HET_MIX/pretrain_llama_$HET_SIZE.sh" nodes
    nodes="$(sed -n 's/^#SBATCH --nodes=//p' "$HET_REPO/$script")"
    sed -n '2,/^#SBATCH/p' "$HET_REPO/$script" | grep '^#' | grep -v '^#SBATCH\|^# Modes, flags' \
        | sed 's/^# \{0,1\}//'
    cat <<EOF

Usage:
  DRY_RUN=1 $script      # validate plan, cluster, model and batch here
  # on every node (torchrun):
  NODE_RANK=<n> MASTER_ADDR=<node 0> DATA_PATH=... TOKENIZER_MODEL=... CHECKPOINT_DIR=... \\
      $script
  # Slurm ($nodes nodes; from the repository root):
  LAUNCHER=slurm NODE_ORDER="<hosts in the cluster file's order>" DATA_PATH=... \\
      TOKENIZER_MODEL=... CHECKPOINT_DIR=... sbatch $script
  # Slurm heterogeneous job: one component per node group, in the cluster file's order,
  # each with its own device request; its hosts in that order are the node order:
  LAUNCHER=slurm DATA_PATH=... CHECKPOINT_DIR=... sbatch \\
      --nodes=<n0> --exclusive --ntasks-per-node=1 <devices> \\
      : --nodes=<n1> --exclusive --ntasks-per-node=1 <devices> $script

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
  other arguments go to pretrain_llama.py (e.g. --train-iters 10)

Variables:
  DATA_PATH        dataset prefix(es) (PREFIX.bin/.idx, or "W1 P1 W2 P2" to blend); required for
                   training, a dry run without it uses --mock-data
  TOKENIZER_MODEL  SentencePiece model; without it NullTokenizer over pre-tokenized ids
  NULL_VOCAB_SIZE  NullTokenizer --vocab-size (default $HET_NULL_VOCAB: the model's vocabulary
                   minus its eod id)
  CHECKPOINT_DIR   --save/--load directory (resumes from its latest checkpoint) on a filesystem
                   every node mounts at the same path (checked at start-up); required for
                   training; SAVE_INTERVAL (default 500)
  LOG_DIR          metrics.jsonl and tensorboard/ (default \$CHECKPOINT_DIR/logs);
                   TENSORBOARD_DIR overrides \$LOG_DIR/tensorboard
  MASTER_ADDR, MASTER_PORT  rendezvous host (node 0) and port (default 29500)
  NODE_RANK        this node's index in the cluster file's node order (node 0: the first node
                   of its first node group)
  NODE_ORDER       Slurm: the allocation's hosts in the cluster file's node order ("a1 a2 m1",
                   "a1,a2,m1" or "a[1-2],m1"); each node task takes its place in it as NODE_RANK
                   and its first host as MASTER_ADDR. Without it Slurm's node order is used
                   (a heterogeneous job's: its components' hosts in order), and a job whose
                   nodes come in another order stops at start-up (each rank checks its device
                   against the kind the cluster file gives it)
  CLUSTER, PLAN    override $HET_CLUSTER / $HET_PLAN
  BRIDGE           relay | direct (default $HET_BRIDGE)
  TRAIN_ITERS, LR_WARMUP_ITERS, SEED, SPLIT   run length, warm-up, seed, data split
  PYTHON           interpreter (default: the repository's .venv, else python3)
  HET_SOCKET_IFNAME, HET_IB_HCA  site network interface (gloo, NCCL and HCCL bind to it; needed
                   where a node's hostname resolves to a loopback address such as 127.0.1.1)
                   and IB/RoCE adapters
  HET_EXTRA_ENV    a file sourced last on every node (another vendor's variables, site tweaks)
EOF
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

# The pretrain_llama.py arguments of this run, into HET_ARGS (DRY=1 for a dry run).
het_build_args() {
    local dry="$1" iters="${TRAIN_ITERS:-500000}"
    # Batch sizes come from the plan.
    HET_ARGS=(pretrain_llama.py --model "$HET_MODEL" --seq-length "$HET_SEQ_LENGTH"
              --cluster "$CLUSTER" --plan "$PLAN" --bridge "$BRIDGE"
              --use-distributed-optimizer --bf16 --train-iters "$iters"
              --lr "$HET_LR" --min-lr "$HET_MIN_LR" --lr-decay-style cosine
              --lr-warmup-iters "${LR_WARMUP_ITERS:-$HET_WARMUP_ITERS}" --lr-decay-iters "$iters"
              --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8
              --clip-grad 1.0 --eval-interval 1000 --eval-iters 10 --seed "${SEED:-1234}")
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
    # (the +-form: an empty array under `set -u` is an error in bash before 4.4)
    HET_ARGS+=(${HET_EXTRA[@]+"${HET_EXTRA[@]}"})
}

# The HET_* facts of node NODE (scripts/common/node_info.py reads the cluster file).
het_node_facts() {
    local facts
    facts="$("$PYTHON" "$HET_REPO/scripts/common/node_info.py" --cluster "$CLUSTER" \
             --node-rank "$1")" || exit 2
    eval "$facts"
}

# Export the environment of node NODE (its vendors' settings).
het_node_env() {
    het_node_facts "$1"
    het_env_common
    local vendor
    for vendor in $HET_NODE_VENDORS; do
        case "$vendor" in
            huawei) het_vendor_env "$vendor" "$HET_NODE_NPUS" || exit 2 ;;
            *) het_vendor_env "$vendor" "$HET_NODE_GPUS" || exit 2 ;;
        esac
    done
    if [ -n "${HET_EXTRA_ENV:-}" ]; then
        # shellcheck disable=SC1090
        source "$HET_EXTRA_ENV"
    fi
}

# Run (or, with PRINT_ONLY=1, print) a command, listing the variables this script exported.
het_exec() {
    if [ "${PRINT_ONLY:-0}" = 1 ]; then
        het_show_env
        het_show_command "$@"
        exit 0
    fi
    exec "$@"
}

# PRINT_ONLY's output: the variables this script exported or changed, and a command line.
het_show_env() {
    comm -13 <(printf '%s\n' "$HET_ENV_BEFORE") <(export -p | sort)
}

het_show_command() {
    printf '+'; printf ' %q' "$@"; printf '\n'
}

# The host names of a Slurm host list ("gpu[01-02] mi[01-04]", or names separated by commas
# or spaces), one per line, in its order.
het_hostnames() {
    local list="$1"
    if [[ "$list" == *"["* ]]; then
        scontrol show hostnames "$list" || het_die "scontrol cannot expand the host list '$list'"
    else
        tr ', \t' '\n\n\n' <<< "$list" | sed '/^$/d'
    fi
}

# Slurm, in the batch step: one task per node, each re-entering the mix script as a node task.
# A heterogeneous job (sbatch OPTS0 : OPTS1 ..., e.g. one component per device GRES) gets one
# step per component, its components' hosts in order being the cluster file's node order.
het_slurm_fanout() {
    [ -n "${SLURM_JOB_ID:-}" ] || het_die "LAUNCHER=slurm needs a Slurm allocation; submit with sbatch or run inside salloc"
    het_node_facts 0
    local -a counts=("$HET_NNODES")
    if [ "${SLURM_HET_SIZE:-1}" -gt 1 ]; then
        het_slurm_components
        counts=("${HET_COMPONENT_NODES[@]}")
    elif [ -n "${SLURM_JOB_NUM_NODES:-}" ] && [ "$SLURM_JOB_NUM_NODES" != "$HET_NNODES" ]; then
        het_die "the allocation has $SLURM_JOB_NUM_NODES nodes but cluster $(basename "$CLUSTER") needs $HET_NNODES; use sbatch --nodes=$HET_NNODES"
    fi
    if [ -n "${NODE_ORDER:-}" ]; then
        local listed
        listed="$(het_hostnames "$NODE_ORDER" | wc -l)"
        [ "$listed" -eq "$HET_NNODES" ] \
            || het_die "NODE_ORDER lists $listed hosts but cluster $(basename "$CLUSTER") has $HET_NNODES nodes; list every node once, in the cluster file's order"
    fi
    # A plain job ends when any node's task fails. An elastic one must outlive a lost node:
    # the supervisors left relaunch on the devices left (submit it with sbatch --no-kill too,
    # or Slurm ends the whole job when a node fails).
    local -a keep=(--kill-on-bad-exit=1)
    if [ "${ELASTIC:-0}" = 1 ]; then keep=(--kill-on-bad-exit=0 --no-kill); fi
    local -a task=("${keep[@]}" --export=ALL,HET_SLURM_NODE=1
                   bash "$HET_REPO/scripts/$HET_MIX/pretrain_llama_$HET_SIZE.sh" "$@")
    if [ "${#counts[@]}" -eq 1 ]; then
        het_exec srun --nodes="$HET_NNODES" --ntasks="$HET_NNODES" --ntasks-per-node=1 \
            "${task[@]}"
    fi
    het_run_steps "${counts[*]}" "${task[@]}"
}

# A heterogeneous job's components: HET_COMPONENT_NODES (each one's node count), and, unless
# given, NODE_ORDER exported as their hosts in component order. A component must end where the
# nodes' kinds change (HET_KIND_RUNS): components are node groups, or runs of them, in the
# cluster file's order, and a boundary elsewhere means the counts do not match the groups.
het_slurm_components() {
    local i var list text hosts="" total=0
    HET_COMPONENT_NODES=()
    for ((i = 0; i < SLURM_HET_SIZE; i++)); do
        var="SLURM_JOB_NODELIST_HET_GROUP_$i"
        list="${!var:-}"
        [ -n "$list" ] || het_die "the heterogeneous job has $SLURM_HET_SIZE components but $var is not set; run the script as the job's batch script"
        text="$(het_hostnames "$list")" || exit 2
        local -a names
        mapfile -t names <<< "$text"
        HET_COMPONENT_NODES+=("${#names[@]}")
        total=$((total + ${#names[@]}))
        hosts="$hosts ${names[*]}"
    done
    [ "$total" -eq "$HET_NNODES" ] \
        || het_die "the heterogeneous job's $SLURM_HET_SIZE components have $total nodes (${HET_COMPONENT_NODES[*]}) but cluster $(basename "$CLUSTER") needs $HET_NNODES; give each node group's nodes to the components, in the cluster file's order"
    local -A run_ends=()
    local end=0 run
    for run in $HET_KIND_RUNS; do
        end=$((end + run))
        run_ends[$end]=1
    done
    end=0
    for i in "${!HET_COMPONENT_NODES[@]}"; do
        end=$((end + HET_COMPONENT_NODES[i]))
        [ -n "${run_ends[$end]:-}" ] \
            || het_die "the heterogeneous job's component $i ends at node $end of cluster $(basename "$CLUSTER"), inside a run of nodes of one kind (runs of $HET_KIND_RUNS nodes in the cluster file's order); give each component whole node groups, in that order"
    done
    if [ -z "${NODE_ORDER:-}" ]; then
        NODE_ORDER="${hosts# }"
        export NODE_ORDER
        return
    fi
    local given
    given="$(het_hostnames "$NODE_ORDER")" || exit 2
    [ "$(sort <<< "$given")" = "$(tr ' ' '\n' <<< "${hosts# }" | sort)" ] \
        || het_die "NODE_ORDER ($NODE_ORDER) does not list the heterogeneous job's hosts (${hosts# }); list each of them once, in the cluster file's order, or leave NODE_ORDER unset to take the components' order"
}

# Send signal $1 to the steps of het_run_steps still running (its pids and ended).
het_signal_steps() {
    local pid
    for pid in ${pids[@]+"${pids[@]}"}; do
        if [ -z "${ended[$pid]:-}" ]; then kill -s "$1" "$pid" 2>/dev/null || true; fi
    done
}

# Run one srun step per component at once: het_run_steps "N0 N1 ..." TASK..., where Ni is
# component i's node count and TASK what its step runs (srun options, then the command). A
# plain job stops the other steps when one fails (as --kill-on-bad-exit does inside a step);
# an elastic one lets them go on. Exits with the first failed step's status, else 0.
het_run_steps() {
    local -a counts
    read -r -a counts <<< "$1"
    shift
    local i
    if [ "${PRINT_ONLY:-0}" = 1 ]; then
        het_show_env
        for i in "${!counts[@]}"; do
            het_show_command srun --het-group="$i" --nodes="${counts[$i]}" \
                --ntasks="${counts[$i]}" --ntasks-per-node=1 "$@"
        done
        exit 0
    fi
    # A signal for the batch step (scancel -b, sbatch --signal=B:...) goes on to the steps, as
    # it would reach the one srun the batch step otherwise becomes (SIGTERM: the run saves at
    # the end of its iteration and exits). Set before the steps start; ended steps are skipped.
    local -a pids=()
    local -A ended=()
    local sig
    for sig in TERM INT HUP USR1 USR2; do
        # shellcheck disable=SC2064
        trap "het_signal_steps $sig" "$sig"
    done
    for i in "${!counts[@]}"; do
        srun --het-group="$i" --nodes="${counts[$i]}" --ntasks="${counts[$i]}" \
            --ntasks-per-node=1 "$@" &
        pids+=("$!")
    done
    # Poll the steps (wait -n needs bash 4.3): a step no longer among the running jobs ended.
    # A signal to the whole job step also ends the poll's sleep: carry on waiting for the
    # steps, which are saving.
    local status=0 code pid running
    while [ "${#ended[@]}" -lt "${#pids[@]}" ]; do
        sleep 0.5 || true
        running=" $(jobs -rp | tr '\n' ' ') " || true
        for pid in "${pids[@]}"; do
            if [ -n "${ended[$pid]:-}" ] || [[ "$running" == *" $pid "* ]]; then continue; fi
            ended[$pid]=1
            code=0
            wait "$pid" || code=$?
            if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then
                status="$code"
                if [ "${ELASTIC:-0}" != 1 ]; then het_signal_steps TERM; fi
            fi
        done
    done
    exit "$status"
}

# A Slurm node task's NODE_RANK and MASTER_ADDR: with NODE_ORDER, this host's place in it and
# its first host; otherwise Slurm's node index and the allocation's first host, which is the
# cluster file's order only when Slurm lists the nodes in that order (the start-up device
# check stops a job whose nodes are out of order).
het_slurm_node() {
    local me="${SLURMD_NODENAME:-$(hostname -s)}"
    if [ -n "${NODE_ORDER:-}" ]; then
        local -a hosts
        local text
        text="$(het_hostnames "$NODE_ORDER")" || exit 2
        mapfile -t hosts <<< "$text"
        local i
        NODE_RANK=""
        for i in "${!hosts[@]}"; do
            if [ "${hosts[$i]}" = "$me" ]; then NODE_RANK="$i"; fi
        done
        [ -n "$NODE_RANK" ] || het_die "this node ($me) is not in NODE_ORDER; list the allocation's hosts in the cluster file's order"
        MASTER_ADDR="${MASTER_ADDR:-${hosts[0]}}"
    else
        NODE_RANK="${SLURM_NODEID:?SLURM_NODEID is not set; srun starts the node tasks}"
        if [ -z "${MASTER_ADDR:-}" ]; then
            MASTER_ADDR="$(het_hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
        fi
    fi
}

# Stop early when Slurm gave this node fewer GPUs than its GPU ranks (cgroups hide the rest).
het_slurm_devices() {
    if [ -n "${SLURM_GPUS_ON_NODE:-}" ] && [ "$SLURM_GPUS_ON_NODE" -lt "$HET_NODE_GPUS" ]; then
        het_die "Slurm gave node $NODE_RANK $SLURM_GPUS_ON_NODE GPUs but it runs $HET_NODE_GPUS GPU ranks; submit with sbatch --gpus-per-node=$HET_NODE_GPUS"
    fi
}

# The repository root: two levels above this file, or (sbatch runs a copy of the mix script,
# which then sources this file from the submission directory) that directory.
het_repo_root() {
    local here
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    [ -f "$here/pretrain_llama.py" ] \
        || het_die "cannot find the repository root; run the script from its checkout or sbatch it from the repository root"
    printf '%s' "$here"
}

het_main() {
    HET_ENV_BEFORE="$(export -p | sort)"
    HET_REPO="$(het_repo_root)" || exit 2
    cd "$HET_REPO"
    het_parse_flags "$@"
    CLUSTER="${CLUSTER:-$HET_CLUSTER}"
    PLAN="${PLAN:-$HET_PLAN}"
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
        het_slurm_node
    fi
    [ -n "${NODE_RANK:-}" ] || het_die "NODE_RANK is not set; export NODE_RANK=<this node's index in $CLUSTER> on every node"
    [ -n "${MASTER_ADDR:-}" ] || het_die "MASTER_ADDR is not set; export MASTER_ADDR=<hostname of node 0>"
    het_node_env "$NODE_RANK"
    if [ "$LAUNCHER" = slurm ]; then
        het_slurm_devices
    fi
    echo "[launch] $HET_MIX node $NODE_RANK/$HET_NNODES: $HET_NODE_NPROC x $HET_NODE_ACCELERATORS" \
         "(ranks $HET_NODE_FIRST_RANK..$((HET_NODE_FIRST_RANK + HET_NODE_NPROC - 1)) of $HET_WORLD_SIZE)" >&2
    # Static rendezvous, even where a PET_RDZV_BACKEND in the site's environment says otherwise:
    # node 0's agent serves the job's store at MASTER_ADDR:MASTER_PORT and no agent calls it
    # while training. A c10d agent calls its store every monitor tick, and when the store's node
    # dies without closing its connections each call waits out the store's read timeout (60 s),
    # so the nodes left would not end within --distributed-timeout-minutes.
    if [ "${ELASTIC:-0}" = 1 ]; then
        het_exec "$PYTHON" tools/elastic_run.py --max-restarts "${MAX_RESTARTS:-3}" \
            --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" \
            --master-port "${MASTER_PORT:-29500}" --node-addr "${NODE_ADDR:-$(hostname)}" \
            -- "${HET_ARGS[@]:1}"
    fi
    het_exec "$PYTHON" -m torch.distributed.run --nnodes "$HET_NNODES" \
        --nproc_per_node "$HET_NODE_NPROC" --node_rank "$NODE_RANK" \
        --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
        --rdzv_backend static "${HET_ARGS[@]}"
}
