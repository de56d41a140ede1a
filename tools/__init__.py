"""Command-line tools beside ``pretrain_llama.py`` (``python tools/plan.py --help``, ...).

Each tool is a thin script over the package; tests import a tool's functions as
``tools.<name>``.
"""
