"""Measured costs of one accelerator kind: the profile JSON format, loading, saving and lookup.

JSON form ("megatron_het.profile/1"), one file per accelerator kind; times in seconds::

    {"format": "megatron_het.profile/1", "accelerator": "H100",
     "conditions": {"device_name": "NVIDIA H100 80GB HBM3", "torch_version": "2.5.1",
                    "threads": 8, "date": "2026-11-30", "dtype": "bf16", "host": "node17"},
     "layers": [{"hidden": 4096, "ffn": 14336, "heads": 32, "kv_groups": 8, "seq": 4096,
                 "micro_batch": 1, "tp": 2, "dtype": "bf16", "forward_s": 0.0061,
                 "backward_s": 0.0125, "activation_bytes": 419430400,
                 "compiled": false}],
     "embedding": [{"hidden": 4096, "vocab": 128256, "seq": 4096, "micro_batch": 1, "tp": 2,
                    "dtype": "bf16", "forward_s": 0.0002, "backward_s": 0.0004}],
     "head": [{... same keys ...}],          # final norm + output layer + cross-entropy
     "optimizer_step_s_per_param": 1.1e-11,  # Adam step, per parameter held by the rank
     "comm": [{"op": "p2p", "link_kind": "intra_node", "bandwidth_gbps": 310.0,
               "latency_s": 8e-6},
              {"op": "collective", "link_kind": "inter_node", "bandwidth_gbps": 42.0,
               "latency_s": 2.5e-5}],
     "host_sharing": [1.0, 1.02, 1.51, 2.03],   # optional, CPU hosts: see below
     "host_collective_s": [2.4e-3, 1.2e-3]}

A layer entry is for one TP rank and one micro-batch. Lookup (:meth:`Profile.layer` and
friends) returns the figures and says how they were found: ``exact``; ``interpolated`` /
``extrapolated`` linearly in tokens (micro_batch x seq) between two entries of the same shape;
``scaled`` in proportion to tokens from the one entry of that shape; otherwise ``nearest``: the
entry of the same dtype whose shape is closest (sum of |log ratios|), scaled by the ratio of
roofline work (FLOPs for layers and the head, bytes for the embedding). No entry of the dtype:
None, and the caller falls back to roofline estimates. A layer entry's ``compiled`` (optional,
false by default) says whether the layer ran compiled (``tools/profile_device.py --compile``,
as training's ``--compile`` runs it) or eager; :meth:`Profile.layer` looks among the entries of
the mode it is asked for.

``host_sharing`` (CPU hosts, where several ranks run as processes of one machine, as CPU-emulated
kinds do): entry ``n - 1`` is how many times longer a single-threaded compute pass takes when
``n`` processes compute at once on the host than the profile's own times (about 1.0 for
``n = 1``; about ``n / cores`` once the cores are full). ``host_collective_s`` (same hosts):
[wall, CPU] seconds of one TP all-reduce of the profiled activations between two processes
that compute between their collectives, as TP ranks do. Both measured by
:mod:`megatron_het.emulation.host_measure` and read only by emulation's rate model (the
predictor ignores them unless given it).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_het.cluster.nodes import LINK_KINDS  # a profile's links are the cluster's kinds
from megatron_het.errors import UserError
from megatron_het.fileio import read_json_file
from megatron_het.perf.cost.roofline import (
    DTYPE_BYTES,
    LayerShape,
    embedding_forward_ops,
    head_forward_flops,
    layer_activation_bytes,
    layer_forward_flops,
)

PROFILE_FORMAT = "megatron_het.profile/1"
COMM_OPS = ("p2p", "collective")


@dataclass(frozen=True)
class ProfileConditions:
    """Where and how a profile was measured (``dtype`` and ``host`` may be left out)."""

    device_name: str
    torch_version: str
    threads: int
    date: str
    dtype: str = ""
    host: str = ""


@dataclass(frozen=True)
class LayerEntry:
    """One decoder layer on one TP rank, one micro-batch: measured times and saved bytes;
    ``compiled``: the layer ran compiled with torch.compile (else eager)."""

    hidden: int
    ffn: int
    heads: int
    kv_groups: int
    seq: int
    micro_batch: int
    tp: int
    dtype: str
    forward_s: float
    backward_s: float
    activation_bytes: float
    compiled: bool = False

    def shape(self) -> LayerShape:
        return LayerShape(
            self.hidden, self.ffn, self.heads, self.kv_groups, self.seq, self.micro_batch, self.tp
        )


@dataclass(frozen=True)
class EndEntry:
    """The embedding, or the head (final norm + output layer + loss), on one TP rank."""

    hidden: int
    vocab: int
    seq: int
    micro_batch: int
    tp: int
    dtype: str
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class CommEntry:
    """Measured bandwidth (GB/s, as the communicator achieved it) and latency of one op kind
    over one kind of link."""

    op: str
    link_kind: str
    bandwidth_gbps: float
    latency_s: float


@dataclass(frozen=True)
class Measured:
    """A lookup result; ``source`` says which entries gave it and how."""

    forward_s: float
    backward_s: float
    activation_bytes: float | None
    source: str


@dataclass(frozen=True)
class Profile:
    """Every measurement of one accelerator kind (see the module docstring for the format)."""

    accelerator: str
    conditions: ProfileConditions
    layers: tuple[LayerEntry, ...] = ()
    embedding: tuple[EndEntry, ...] = ()
    head: tuple[EndEntry, ...] = ()
    optimizer_step_s_per_param: float | None = None
    comm: tuple[CommEntry, ...] = ()
    host_sharing: tuple[float, ...] = ()
    host_collective_s: tuple[float, ...] = ()

    # ---- lookup ---------------------------------------------------------------------------
    def layer(self, shape: LayerShape, dtype: str, compiled: bool | None = None) -> Measured | None:
        """One layer's forward/backward seconds and activation bytes for ``shape``, from the
        entries of ``dtype`` (and, unless ``compiled`` is None, of that mode only)."""
        key = _widths(shape)
        candidates = [
            (e, _widths(e), e.seq, e.micro_batch, (e.forward_s, e.backward_s, e.activation_bytes))
            for e in self.layers
            if e.dtype == dtype and (compiled is None or e.compiled == compiled)
        ]

        def work(entry: LayerEntry) -> tuple[float, float]:
            s = entry.shape()
            return layer_forward_flops(s), layer_activation_bytes(s, dtype)

        target = (layer_forward_flops(shape), layer_activation_bytes(shape, dtype))
        found = _lookup(candidates, key, shape.seq, shape.micro_batch, work, target)
        if found is None:
            return None
        (fwd, bwd, act), source = found
        mode = "" if compiled is None else ("compiled " if compiled else "eager ")
        return Measured(fwd, bwd, act, f"profile {self.accelerator}: {mode}{source}")

    def has_layer_shape(self, shape: LayerShape, dtype: str, compiled: bool) -> bool:
        """Whether an entry of ``dtype`` and mode ``compiled`` has ``shape``'s widths and tp
        (at any sequence length and micro-batch: :meth:`layer` then scales it in tokens, not
        from another shape)."""
        return any(
            _widths(e) == _widths(shape) and e.dtype == dtype and e.compiled == compiled
            for e in self.layers
        )

    def end(self, part: str, shape: LayerShape, vocab: int, dtype: str) -> Measured | None:
        """``part`` "embedding" or "head": forward/backward seconds on one TP rank."""
        entries = {"embedding": self.embedding, "head": self.head}[part]
        key = (shape.hidden, vocab, shape.tp)
        candidates = [
            (e, (e.hidden, e.vocab, e.tp), e.seq, e.micro_batch, (e.forward_s, e.backward_s))
            for e in entries
            if e.dtype == dtype
        ]

        def amount(s: LayerShape, v: int) -> float:
            if part == "head":
                return head_forward_flops(s, v)
            return sum(op.elements for op in embedding_forward_ops(s))

        def work(entry: EndEntry) -> tuple[float, float]:
            s = LayerShape(entry.hidden, 1, 1, 1, entry.seq, entry.micro_batch, entry.tp)
            return amount(s, entry.vocab), amount(s, entry.vocab)

        target = (amount(shape, vocab),) * 2
        found = _lookup(candidates, key, shape.seq, shape.micro_batch, work, target)
        if found is None:
            return None
        (fwd, bwd), source = found
        return Measured(fwd, bwd, None, f"profile {self.accelerator} {part}: {source}")

    def comm_figures(self, op: str, link_kind: str) -> CommEntry | None:
        """The measured figures of ``op`` (p2p | collective) over ``link_kind``, if any."""
        for entry in self.comm:
            if entry.op == op and entry.link_kind == link_kind:
                return entry
        return None

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        out: dict[str, Any] = {"format": PROFILE_FORMAT}
        out.update({k: list(v) if isinstance(v, tuple) else v for k, v in d.items()})
        return out

    def save(self, path: str | Path) -> None:
        """Write the JSON form to ``path`` (overwrites)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        """Parse the JSON form; a wrong format or key is a one-line UserError."""
        return _parse(d)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        data = read_json_file(
            path,
            f"profile {path}",
            "write it with tools/profile_device.py or leave it out to use roofline estimates",
        )
        try:
            return _parse(data)
        except UserError as exc:
            raise UserError(f"{path}: {exc}") from None


def merge_profiles(old: Profile, new: Profile) -> Profile:
    """``old`` with every entry of ``new`` added, replacing entries about the same thing (same
    dtype, mode (compiled or eager), widths, seq, micro-batch and tp; same op and link for
    comm). The conditions are ``new``'s; so are the optimizer and host figures unless ``new``
    has none."""
    if old.accelerator != new.accelerator:
        raise UserError(
            f"cannot merge a profile of {new.accelerator!r} into one of "
            f"{old.accelerator!r}; write it to its own file"
        )

    def merged(a: Sequence[Any], b: Sequence[Any]) -> tuple:
        out = {_entry_key(e): e for e in a}
        out.update({_entry_key(e): e for e in b})
        return tuple(out.values())

    step = (
        new.optimizer_step_s_per_param
        if new.optimizer_step_s_per_param is not None
        else old.optimizer_step_s_per_param
    )
    return dataclasses.replace(
        new,
        layers=merged(old.layers, new.layers),
        embedding=merged(old.embedding, new.embedding),
        head=merged(old.head, new.head),
        optimizer_step_s_per_param=step,
        comm=merged(old.comm, new.comm),
        host_sharing=new.host_sharing or old.host_sharing,
        host_collective_s=new.host_collective_s or old.host_collective_s,
    )


def _entry_key(entry: Any) -> tuple:
    """What an entry is about: its fields other than the measured figures."""
    return tuple(
        getattr(entry, f.name)
        for f in dataclasses.fields(entry)
        if not f.name.endswith(("_s", "_bytes", "_gbps"))
    )


def load_profiles(paths: Sequence[str | Path]) -> dict[str, Profile]:
    """Profiles keyed by accelerator kind name; two files for one kind is an error."""
    out: dict[str, Profile] = {}
    for path in paths:
        profile = Profile.load(path)
        if profile.accelerator in out:
            raise UserError(
                f"two profiles for accelerator {profile.accelerator!r} "
                f"(the second is {path}); pass one profile per kind"
            )
        out[profile.accelerator] = profile
    return out


def _widths(layer: LayerEntry | LayerShape) -> tuple[int, ...]:
    """What a layer lookup matches exactly: the widths and the TP degree."""
    return (layer.hidden, layer.ffn, layer.heads, layer.kv_groups, layer.tp)


# ---- lookup core --------------------------------------------------------------------------
Candidate = tuple[Any, tuple, int, int, tuple]


def _lookup(
    candidates: list[Candidate],
    key: tuple,
    seq: int,
    micro_batch: int,
    work: Callable[[Any], tuple[float, ...]],
    target: tuple[float, ...],
) -> tuple[tuple[float, ...], str] | None:
    """Values for (key, seq, micro_batch): exact, linear in tokens within the same shape, or
    the nearest shape scaled by ``target / work(entry)`` (one ratio per value group)."""
    if not candidates:
        return None
    tokens = seq * micro_batch
    same = [c for c in candidates if c[1] == key]
    for c in same:
        if c[2] == seq and c[3] == micro_batch:
            return c[4], "exact"
    if same:
        return _linear_in_tokens(same, tokens)

    def distance(c: Candidate) -> float:
        pairs = list(zip(c[1], key)) + [(c[2] * c[3], tokens)]
        return sum(abs(math.log(a / b)) for a, b in pairs)

    nearest = min(candidates, key=distance)
    ratios = [t / w if w else 1.0 for t, w in zip(target, work(nearest[0]))]
    # The last value group (activation bytes) takes the last ratio; times take the first.
    values = tuple(v * (ratios[-1] if i == 2 else ratios[0]) for i, v in enumerate(nearest[4]))
    return values, f"nearest {_describe(nearest)} scaled by roofline work x{ratios[0]:.3g}"


def _linear_in_tokens(same: list[Candidate], tokens: int) -> tuple[tuple[float, ...], str]:
    by_tokens: dict[int, Candidate] = {}
    for c in same:
        by_tokens.setdefault(c[2] * c[3], c)
    points = sorted(by_tokens)
    if len(points) == 1:
        c = by_tokens[points[0]]
        return (
            tuple(v * tokens / points[0] for v in c[4]),
            f"scaled in proportion to tokens from {_describe(c)}",
        )
    below = [t for t in points if t <= tokens]
    above = [t for t in points if t >= tokens]
    if below and above:
        t0, t1, how = below[-1], above[0], "interpolated"
    elif below:
        t0, t1, how = points[-2], points[-1], "extrapolated"
    else:
        t0, t1, how = points[0], points[1], "extrapolated"
    c0, c1 = by_tokens[t0], by_tokens[t1]
    w = (tokens - t0) / (t1 - t0)
    values = tuple(max(0.0, a + w * (b - a)) for a, b in zip(c0[4], c1[4]))
    return values, f"{how} in tokens between {_describe(c0)} and {_describe(c1)}"


def _describe(c: Candidate) -> str:
    return f"{c[1]} seq={c[2]} mb={c[3]}"


# ---- parsing ------------------------------------------------------------------------------
_TOP_KEYS = (
    "format",
    "accelerator",
    "conditions",
    "layers",
    "embedding",
    "head",
    "optimizer_step_s_per_param",
    "comm",
    "host_sharing",
    "host_collective_s",
)


def _record(cls: type, where: str, d: Any) -> Any:
    # Postponed annotations: each field's type is its annotation's text ("str", "int", ...).
    fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    if not isinstance(d, Mapping):
        raise UserError(f"{where}: expected an object with keys {', '.join(fields)}")
    unknown = [k for k in d if k not in fields]
    missing = [k for k in fields if k not in d and k not in optional]
    if unknown or missing:
        what = f"unknown key {unknown[0]!r}" if unknown else f"missing key {missing[0]!r}"
        raise UserError(f"{where}: {what}; keys are {', '.join(fields)}")
    for name, kind in fields.items():
        if name not in d:
            continue
        value = d[name]
        ok = (
            isinstance(value, str)
            if kind == "str"
            else isinstance(value, bool)
            if kind == "bool"
            else not isinstance(value, bool) and isinstance(value, int)
            if kind == "int"
            else not isinstance(value, bool) and isinstance(value, (int, float)) and value >= 0
        )
        if not ok:
            raise UserError(f"{where}: {name} must be {_KIND_WORDS[kind]}, got {value!r}")
    return cls(**d)


_KIND_WORDS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number >= 0",
    "bool": "true or false",
}


def _parse(d: Any) -> Profile:
    if not isinstance(d, Mapping) or d.get("format") != PROFILE_FORMAT:
        got = d.get("format") if isinstance(d, Mapping) else d
        raise UserError(f"not a profile: format must be {PROFILE_FORMAT!r}, got {got!r}")
    unknown = [k for k in d if k not in _TOP_KEYS]
    if unknown:
        raise UserError(f"profile: unknown key {unknown[0]!r}; keys are {', '.join(_TOP_KEYS)}")
    if not isinstance(d.get("accelerator"), str) or not d["accelerator"]:
        raise UserError("profile: accelerator must name the kind it was measured on")
    step = d.get("optimizer_step_s_per_param")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))):
        raise UserError(f"profile: optimizer_step_s_per_param must be a number, got {step!r}")
    comm = tuple(_record(CommEntry, f"comm #{i}", c) for i, c in enumerate(d.get("comm", [])))
    host = {}
    for key, what in (
        ("host_sharing", "slowdown with 1, 2, ... processes computing at once"),
        ("host_collective_s", "[wall, CPU] seconds of one TP collective"),
    ):
        values = d.get(key, [])
        if not isinstance(values, list) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in values
        ):
            raise UserError(
                f"profile: {key} must be a list of positive numbers ({what}), got {values!r}"
            )
        host[key] = tuple(float(v) for v in values)
    if host["host_collective_s"] and len(host["host_collective_s"]) != 2:
        raise UserError(
            "profile: host_collective_s must be [wall, CPU] seconds of one TP "
            f"collective, got {list(host['host_collective_s'])}"
        )
    for c in comm:
        if c.op not in COMM_OPS or c.link_kind not in LINK_KINDS or c.bandwidth_gbps <= 0:
            raise UserError(
                f"profile comm entry {c}: op must be one of {COMM_OPS}, link_kind "
                f"one of {LINK_KINDS}, bandwidth_gbps positive"
            )
    entries = {}
    for part, cls in (("layers", LayerEntry), ("embedding", EndEntry), ("head", EndEntry)):
        entries[part] = tuple(
            _record(cls, f"{part} #{i}", e) for i, e in enumerate(d.get(part, []))
        )
        for i, e in enumerate(entries[part]):
            if e.dtype not in DTYPE_BYTES:
                raise UserError(
                    f"{part} #{i}: dtype must be one of {', '.join(DTYPE_BYTES)}, got {e.dtype!r}"
                )
    return Profile(
        accelerator=d["accelerator"],
        conditions=_record(ProfileConditions, "conditions", d.get("conditions")),
        optimizer_step_s_per_param=None if step is None else float(step),
        comm=comm,
        host_sharing=host["host_sharing"],
        host_collective_s=host["host_collective_s"],
        **entries,
    )
