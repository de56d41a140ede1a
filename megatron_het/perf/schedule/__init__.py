"""The pipeline schedule's timing, per-stage costs in and a pipeline's time out: ``simulator``
runs the runtime's 1F1B step lists event by event (plain or interleaved, on shared cores or
not); ``closed_forms`` holds the analytic forms and bounds that check it and
``closed_form_pipeline``, the fast estimate the predictor and the planner share;
``simulation_cache`` memoizes step lists, makespans and stage computes over a search loop.
"""
