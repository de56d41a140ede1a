"""Launching and supervising runs: everything between a user's command and a rank's world.

Per node: ``python -m megatron_het.launcher`` (what ``scripts/<mix>/pretrain_llama_<size>.sh``
runs) reads a mix's settings file, sets the node's per-vendor environment and starts torchrun
with a static rendezvous, under Slurm too (:mod:`.node_launch`). Per rank: torchrun's
environment becomes a :class:`~.launch_env.LaunchEnv`, the rank picks and checks its device
(:mod:`.rank_device`), the ranks agree at start-up (:mod:`.start_agreement`) and join the world
(:mod:`.world`); while training every rank beats in the rendezvous store (:mod:`.peer_watch`).
After a lost peer the elastic supervisor (``tools/elastic_run.py``, :mod:`.supervisor`)
relaunches on the devices left (:mod:`.shrink`). The package imports nothing of training.
"""
