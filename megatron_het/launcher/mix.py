"""A mix's settings file (``scripts/<mix>/mix_<size>.yaml``) -> :class:`MixSettings`.

A mix is a cluster, a plan for it and a model with its run settings; the launcher reads them
from one small YAML file per mix, and the mix's shell script (``pretrain_llama_<size>.sh``
beside it) only finds the repository and the interpreter and hands the file over. Every key of
:class:`MixSettings` is required and no other is allowed: a mistake is one line that names it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_het.arguments import BRIDGES
from megatron_het.errors import UserError


@dataclass(frozen=True)
class MixSettings:
    """One mix: its ``name`` (its folder under scripts/) and model ``size`` (its script is
    ``scripts/<name>/pretrain_llama_<size>.sh``), its ``cluster`` YAML and ``plan`` JSON (paths
    from the repository root), the ``model`` preset and ``seq_length``, ``null_vocab_size``
    (NullTokenizer ``--vocab-size``: the model's vocabulary minus its eod id), the ``bridge``
    between kinds (relay | direct), and the learning-rate schedule (``lr``, ``min_lr``,
    ``warmup_iters``)."""

    name: str
    size: str
    cluster: str
    plan: str
    model: str
    seq_length: int
    null_vocab_size: int
    bridge: str
    lr: float
    min_lr: float
    warmup_iters: int

    @property
    def script(self) -> str:
        """The mix's shell script, from the repository root."""
        return f"scripts/{self.name}/pretrain_llama_{self.size}.sh"


KEYS = tuple(field.name for field in dataclasses.fields(MixSettings))
# Integer settings and their least value.
_INTEGERS = {"seq_length": 1, "null_vocab_size": 1, "warmup_iters": 0}
_FLOATS = ("lr", "min_lr")


def load_mix(path: str | Path) -> MixSettings:
    """Read and check the settings file at ``path``; UserError (one line) for a missing file,
    a missing or unknown key, or a value of the wrong type."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UserError(f"mix file {path} not found; pass a scripts/<mix>/mix_<size>.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        line = str(exc).replace("\n", " ")
        raise UserError(f"mix file {path} is not valid YAML ({line})") from None
    if not isinstance(data, dict):
        raise UserError(f"mix file {path} must map setting names to values ({', '.join(KEYS)})")
    unknown = sorted(str(key) for key in data if key not in KEYS)
    if unknown:
        raise UserError(
            f"mix file {path} has unknown key(s) {', '.join(unknown)}; the keys are "
            f"{', '.join(KEYS)}"
        )
    missing = [key for key in KEYS if key not in data]
    if missing:
        raise UserError(f"mix file {path} lacks {', '.join(missing)}; add a value for each")
    values = {key: _value(path, key, data[key]) for key in KEYS}
    if values["bridge"] not in BRIDGES:
        raise UserError(
            f"mix file {path}: bridge must be {' or '.join(BRIDGES)}, got {values['bridge']}"
        )
    return MixSettings(**values)


def _value(path: Path, key: str, value: Any) -> Any:
    """``value`` of ``key`` as its field's type (a YAML number may come as text: 1e-4)."""
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        raise UserError(f"mix file {path}: {key} must be a single value, got {value!r}")
    try:
        if key in _INTEGERS:
            number = int(str(value))
            if number < _INTEGERS[key]:
                raise ValueError
            return number
        if key in _FLOATS:
            return float(value)
    except ValueError:
        kind = f"an integer of at least {_INTEGERS[key]}" if key in _INTEGERS else "a number"
        raise UserError(f"mix file {path}: {key} must be {kind}, got {value!r}") from None
    return str(value)
