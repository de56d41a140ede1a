"""How long the planner searches at scale (no device needed; one core).

    .venv/bin/python -m bench.planner_scale [--only hethub,16k] [--repeat N]

Cases:

* ``hethub``: Llama-140B on the HETHUB paper's 768-device mix (scripts/clusters/
  hethub_llama140b.yaml), global batch 1024, sequence 4096: the plan search, then the
  homogeneous baseline's per-kind searches (what ``tools/plan.py`` adds for ``efficiency``);
* ``16k``: Llama-140B on 16,384 devices of three kinds (scripts/clusters/
  h100_mi300x_a100_16k.yaml), global batch 4096, sequence 4096: the plan search alone.

Prints one line per case and repeat (stderr), then one JSON line last: per case the median
search seconds over the repeats, the layouts probed, the plan and its predicted iteration time.
The search is deterministic, so repeats differ only by the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from megatron_het.cluster import ClusterSpec
from megatron_het.config import model_preset
from megatron_het.planner import homogeneous_baseline, search_plan

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "hethub": ("hethub_llama140b.yaml", "llama-140b", 1024, 4096, True),
    "16k": ("h100_mi300x_a100_16k.yaml", "llama-140b", 4096, 4096, False),
}


def run_case(name: str) -> dict:
    cluster_file, model_name, gbs, seq, with_baseline = CASES[name]
    cluster = ClusterSpec.load(ROOT / "scripts" / "clusters" / cluster_file)
    model = model_preset(model_name)
    start = time.perf_counter()
    result = search_plan(model, cluster, gbs, seq)
    out = {
        "search_s": time.perf_counter() - start,
        "layouts": result.layouts_evaluated,
        "plan": result.plan.description,
        "devices": cluster.world_size,
        "iteration_s": result.prediction.iteration_time_s,
        "tokens_per_s": result.prediction.tokens_per_s,
    }
    if with_baseline:
        start = time.perf_counter()
        homogeneous_baseline(model, cluster, gbs, seq)
        out["baseline_s"] = time.perf_counter() - start
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or args.repeat < 1:
        parser.error(f"unknown case {unknown[0]!r}" if unknown else "--repeat must be >= 1")
    summary = {}
    for name in names:
        runs = []
        for i in range(args.repeat):
            runs.append(run_case(name))
            extra = f", baseline {runs[-1]['baseline_s']:.1f} s" if "baseline_s" in runs[-1] else ""
            print(
                f"{name} #{i + 1}: search {runs[-1]['search_s']:.1f} s over "
                f"{runs[-1]['layouts']} layouts{extra}; {runs[-1]['plan']}",
                file=sys.stderr,
            )
        summary[name] = {
            **runs[-1],
            "search_s": statistics.median(r["search_s"] for r in runs),
            "repeats": args.repeat,
        }
        if "baseline_s" in runs[-1]:
            summary[name]["baseline_s"] = statistics.median(r["baseline_s"] for r in runs)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
