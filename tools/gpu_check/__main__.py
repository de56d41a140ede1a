"""``python -m tools.gpu_check``: see :mod:`tools.gpu_check.cli`."""

from tools.gpu_check.cli import entry

if __name__ == "__main__":
    entry()
