"""The cost model: ``roofline`` prices ops at a kind's ``calibration`` efficiencies;
``compute_time`` gives a stage's compute from a profile or that roofline; ``tp_collectives``
counts its TP collectives, which ``comm_time`` prices over the links, as it does the stage
boundaries (``boundary_time``) and the DP sync (``dp_sync``; what hides under the backward:
``dp_sync_overlap``); ``memory`` counts a device's bytes, ``memory_fit`` checks them, and
``rate_model`` is the interface for ranks that share their cores.
"""
