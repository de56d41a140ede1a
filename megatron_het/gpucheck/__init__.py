"""The GPU check (``scripts/gpu_check.sh``): everything in the project that needs a GPU, checked
in one run of a few minutes on one GPU host, each check in its own process and time budget.

- :mod:`~megatron_het.gpucheck.cli`: the command line, the checks and their budgets;
- :mod:`~megatron_het.gpucheck.runner`: processes, timeouts and failure isolation;
- :mod:`~megatron_het.gpucheck.report`: result rows, the table and the JSON summary;
- :mod:`~megatron_het.gpucheck.metrics_file`: reading and comparing ``--metrics-file`` losses;
- checks: :mod:`~megatron_het.gpucheck.device_checks` (probe, numerics),
  :mod:`~megatron_het.gpucheck.relay_check`, :mod:`~megatron_het.gpucheck.mixed_pair` (with
  :mod:`~megatron_het.gpucheck.pair_files` and :mod:`~megatron_het.gpucheck.gpu_processes`),
  :mod:`~megatron_het.gpucheck.mfu`, :mod:`~megatron_het.gpucheck.profile_check`,
  :mod:`~megatron_het.gpucheck.bench_check`.

Nothing here initialises CUDA at import time; the product does not import this package.
"""
