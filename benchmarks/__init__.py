"""The benchmarks: each module is a command, run from the repository root with ``python -m``.

    python -m benchmarks.imbalance --help
    python -m benchmarks.heterogeneity --help

``benchmarks/harness.py`` holds what the benchmarks share (rank variables and
ports, threads, the CPU stolen by the hypervisor, process-group clean-up);
``benchmarks/imbalance/`` the imbalance benchmark and the task other
benchmarks reuse. Results go to ``benchmarks/results/`` (see docs/benchmarks.md).
"""
