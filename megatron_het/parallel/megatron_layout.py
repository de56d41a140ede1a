"""Megatron-LM's ``--pipeline-model-parallel-layout`` strings, as layer counts per stage.

A layout lists the pipeline's stages (virtual stages included) from first to last, separated
by ``|``: ``E`` is the embedding, ``t`` a decoder layer, ``L`` the loss (the output head);
``X*N`` repeats a token or a parenthesised group N times; commas and spaces are ignored. Stage
i runs on pipeline rank ``i mod pp``, so ``pp * v`` stages give ``v`` interleaved chunks per
rank. For example, with pp 2, ``"Et*2|t*3|t*3|t*2L"`` is 10 layers in 4 chunks: rank 0 runs
chunks of 2 and 3 layers (the first with the embedding), rank 1 chunks of 3 and 2 (the last
with the head).

Each stage must hold at least one decoder layer (a plan's stages do); ``E`` must open the
first stage and ``L`` close the last; other tokens (such as Megatron's ``m`` for multi-token
prediction) are refused with one line.
"""

from __future__ import annotations

import re

from megatron_het.errors import UserError

_TOKEN = re.compile(r"\s*(?:(?P<item>[EtL|()])|(?P<repeat>\*\s*\d+)|(?P<comma>,))")


def _expand(text: str) -> str:
    """The layout with every repetition written out (``(t|)*2`` -> ``t|t|``)."""
    stack: list[list[str]] = [[]]
    position = 0
    while position < len(text.rstrip()):
        match = _TOKEN.match(text, position)
        if match is None:
            bad = text[position:].strip()[:1]
            raise UserError(
                f"--pipeline-model-parallel-layout {text!r}: unknown symbol {bad!r} "
                f"at position {position}; use E (embedding), t (decoder layer), "
                f"L (loss), | (stage break), ( ) and *N"
            )
        position = match.end()
        item, repeat = match.group("item"), match.group("repeat")
        if item == "(":
            stack.append([])
        elif item == ")":
            if len(stack) == 1:
                raise UserError(f"--pipeline-model-parallel-layout {text!r}: ')' without '('")
            group = "".join(stack.pop())
            stack[-1].append(group)
        elif item is not None:
            stack[-1].append(item)
        elif repeat is not None:
            if not stack[-1]:
                raise UserError(
                    f"--pipeline-model-parallel-layout {text!r}: '*' must follow a "
                    f"symbol or a group"
                )
            stack[-1][-1] *= int(repeat.lstrip("*").strip())
    if len(stack) != 1:
        raise UserError(f"--pipeline-model-parallel-layout {text!r}: '(' without ')'")
    return "".join(stack[0])


def layout_layer_counts(layout: str, num_layers: int, pp: int) -> list[int]:
    """Decoder layers of every stage of ``layout`` (see the module docstring), checked
    against the model's ``num_layers`` and the pipeline size ``pp``."""
    where = f"--pipeline-model-parallel-layout {layout!r}"
    stages = _expand(layout).split("|")
    if stages[0][:1] != "E" or stages[0].count("E") != 1 or "E" in "".join(stages[1:]):
        raise UserError(f"{where}: E (the embedding) must open the first stage, once")
    if stages[-1][-1:] != "L" or stages[-1].count("L") != 1 or "L" in "".join(stages[:-1]):
        raise UserError(f"{where}: L (the loss) must close the last stage, once")
    counts = [stage.count("t") for stage in stages]
    if sum(counts) != num_layers:
        raise UserError(
            f"{where} places {sum(counts)} decoder layers but the model has {num_layers}"
        )
    if len(stages) % pp:
        raise UserError(
            f"{where} has {len(stages)} stages, not a multiple of "
            f"--pipeline-model-parallel-size {pp}"
        )
    empty = [i for i, count in enumerate(counts) if count == 0]
    if empty:
        raise UserError(
            f"{where}: stage {empty[0]} holds no decoder layer; give every stage at least one t"
        )
    return counts
