# Per-vendor environment of one node, sourced by scripts/common/launch.sh (not run directly).
#
# het_vendor_env VENDOR NPROC exports the settings of one accelerator vendor (the names
# megatron_het's cluster files use: nvidia, amd, huawei, cpu, other) for a node that runs NPROC
# ranks. Every value uses ${VAR:-default}, so a site sets its own by exporting the variable before
# calling the launch script. Site-specific network names come from two optional variables:
#   HET_SOCKET_IFNAME  host network interface for bootstrap/TCP traffic (e.g. ib0, eth0, bond0)
#   HET_IB_HCA         InfiniBand/RoCE adapters for collectives (e.g. mlx5_0,mlx5_1)
# and HET_EXTRA_ENV may name a file sourced last on every node for anything else.

# The first NPROC device indices, comma separated: 0,1,...,NPROC-1.
het_device_list() {
    local n="$1" i list=""
    for ((i = 0; i < n; i++)); do list+="${list:+,}$i"; done
    printf '%s' "$list"
}

# Settings every node needs whatever its vendor.
het_env_common() {
    # The relay bridge between accelerator kinds stages through host memory and gloo over TCP:
    # pin gloo to the fast host interface when the site names one.
    if [ -n "${HET_SOCKET_IFNAME:-}" ]; then
        export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$HET_SOCKET_IFNAME}"
    fi
    # One OpenMP thread per rank for host-side work (data loading, relay copies); the
    # accelerator does the math, and oversubscribed host threads only add jitter.
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
}

# NVIDIA GPUs: torch's nccl backend runs NCCL.
het_env_nvidia() {
    local nproc="$1"
    # One hardware work queue, so a tensor-parallel collective is issued before the compute that
    # follows it (Megatron's ordering assumption for overlapping TP communication).
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    # Expose exactly this node's ranks' GPUs; local rank i drives GPU i.
    export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-$(het_device_list "$nproc")}"
    # A failed or hung collective aborts the process (and the job) instead of hanging forever.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    # Longer InfiniBand retry timeout (4.096 us * 2^22): large fabrics see transient stalls.
    export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
    # Warnings only; set NCCL_DEBUG=INFO to see the rings/trees NCCL builds.
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    # Site network: NCCL's bootstrap interface and the IB adapters it may use.
    if [ -n "${HET_SOCKET_IFNAME:-}" ]; then
        export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$HET_SOCKET_IFNAME}"
    fi
    if [ -n "${HET_IB_HCA:-}" ]; then
        export NCCL_IB_HCA="${NCCL_IB_HCA:-$HET_IB_HCA}"
    fi
}

# AMD Instinct GPUs (ROCm): torch's nccl backend runs RCCL, which reads the NCCL_* variables.
het_env_amd() {
    local nproc="$1"
    # Expose exactly this node's ranks' GPUs (GCDs on MI250X); local rank i drives device i.
    export HIP_VISIBLE_DEVICES="${HIP_VISIBLE_DEVICES:-$(het_device_list "$nproc")}"
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
    if [ -n "${HET_SOCKET_IFNAME:-}" ]; then
        export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$HET_SOCKET_IFNAME}"
    fi
    if [ -n "${HET_IB_HCA:-}" ]; then
        export NCCL_IB_HCA="${NCCL_IB_HCA:-$HET_IB_HCA}"
    fi
}

# Huawei Ascend NPUs: torch_npu's hccl backend runs HCCL.
het_env_huawei() {
    local nproc="$1"
    # The CANN toolkit's own environment (library paths, ASCEND_HOME_PATH, ...). Its script is
    # not written for `set -u`, so relax that while it runs.
    local cann_env="${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit/latest}/../set_env.sh"
    if [ -f "$cann_env" ]; then
        set +u
        # shellcheck disable=SC1090
        source "$cann_env"
        set -u
    fi
    # Expose exactly this node's ranks' NPUs; local rank i drives NPU i.
    export ASCEND_RT_VISIBLE_DEVICES="${ASCEND_RT_VISIBLE_DEVICES:-$(het_device_list "$nproc")}"
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

# Accelerators of another vendor: nothing is assumed beyond what its cluster entry says (the
# hethub mix's accelerator-a declares a vendor library behind torch's nccl name). Put the
# vendor's own variables in the file named by HET_EXTRA_ENV.
het_env_other() {
    local nproc="$1"
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    : "$nproc"
}

# CPU ranks (plain or emulated kinds): gloo only; nothing vendor-specific.
het_env_cpu() {
    : "$1"
}

# Export the settings of VENDOR for a node running NPROC ranks.
het_vendor_env() {
    local vendor="$1" nproc="$2"
    case "$vendor" in
        nvidia) het_env_nvidia "$nproc" ;;
        amd) het_env_amd "$nproc" ;;
        huawei) het_env_huawei "$nproc" ;;
        cpu) het_env_cpu "$nproc" ;;
        other) het_env_other "$nproc" ;;
        *) echo "error: unknown vendor '$vendor' in the cluster file; use nvidia, amd, huawei, cpu or other" >&2
           return 2 ;;
    esac
}
