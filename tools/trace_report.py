"""Measured against predicted, per stage, from a run's ``--profile`` trace.

    python tools/trace_report.py board/timeline_iters10-11.json
    python tools/trace_report.py board/timeline_iters10-11.json --png timeline.png --json

Prints, per device group of each pipeline, the seconds per iteration of compute, waiting in
the schedule (transfers and the bubble), DP sync, optimizer step, the rest and the whole
iteration, measured beside predicted, then the largest differences first
(:mod:`megatron_het.trace.stage_compare`). ``--png`` draws both timelines
(:mod:`megatron_het.trace.drawing`); ``--json`` prints the rows as JSON instead of the text.
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Sequence
from typing import TextIO

from megatron_het.arguments.parser import ArgParser
from megatron_het.errors import UserError, run_cli
from megatron_het.trace.chrome import read_trace, validate_chrome_trace
from megatron_het.trace.stage_compare import format_report, stage_rows


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    parser = ArgParser(prog="trace_report.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("trace", help="a timeline_iters<A>-<B>.json that --profile wrote")
    parser.add_argument("--png", metavar="PATH", help="also draw both timelines into PATH")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(list(argv))
    out = out or sys.stdout
    path = pathlib.Path(args.trace)
    try:
        trace = read_trace(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read a trace ({exc})") from None
    problems = validate_chrome_trace(trace)
    if problems:
        raise UserError(f"{path}: not a valid Chrome trace: {problems[0]}")
    if args.json:
        rows = [
            {
                "stage": r.label,
                "ranks": list(r.ranks),
                "measured": r.measured,
                "predicted": r.predicted,
            }
            for r in stage_rows(trace)
        ]
        print(json.dumps({"trace": str(path), "rows": rows}), file=out)
    else:
        print(format_report(trace), file=out)
    if args.png:
        from megatron_het.trace.drawing import save_trace_picture

        picture = save_trace_picture(trace, args.png)
        if not args.json:
            print(f"picture: {picture}", file=out)
    return 0


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main(sys.argv[1:])))
