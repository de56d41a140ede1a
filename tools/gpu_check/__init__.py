"""The GPU check (``scripts/gpu_check.sh``, ``make gpu-check``): everything in the project that
needs a GPU, checked in one run of a few minutes on one GPU host, each check in its own process
and time budget. A tool beside the others, not part of the package: it runs the package's
entry points, tools and benchmarks and reads what they print.

- :mod:`~tools.gpu_check.cli`: the command line, the checks and their budgets;
- :mod:`~tools.gpu_check.runner`: processes, timeouts and failure isolation;
- :mod:`~tools.gpu_check.report`: result rows, the table and the JSON summary;
- :mod:`~tools.gpu_check.metrics_file`: reading and comparing ``--metrics-file`` losses;
- checks: :mod:`~tools.gpu_check.device_checks` (probe, numerics),
  :mod:`~tools.gpu_check.relay_check`, :mod:`~tools.gpu_check.mixed_pair` (with
  :mod:`~tools.gpu_check.pair_files` and :mod:`~tools.gpu_check.gpu_processes`),
  :mod:`~tools.gpu_check.mfu`, :mod:`~tools.gpu_check.profile_check`,
  :mod:`~tools.gpu_check.bench_check`.

Nothing here initialises CUDA at import time; the product does not import this package.
"""
