"""Measuring a device into a profile: ``profiler`` sweeps shapes, timing one TP rank's shards
(``shard_cases``) as cases (``timed_cases``), and writes a ``Profile`` (``profile_format``: the
JSON form and its lookup, which the cost model reads); ``communicator_figures`` adds p2p and
all-reduce figures from two gloo ranks run as ``worker_processes``; ``device_kind`` names the
accelerator kind of this device.
"""
