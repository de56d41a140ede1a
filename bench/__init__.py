"""Benchmarks: each prints JSON with its figures and the conditions they were measured under.

Run them from the repository root as modules (``python -m bench.planner_scale``), on an
otherwise idle machine. They are never part of the pass/fail test run; tests import their
shared pieces (``bench.fault_jobs``, ``bench.hetero_plans``) as a package.
"""
