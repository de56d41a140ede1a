"""The GPU check's device-free parts: rows, table and JSON summary; the runner's timeouts and
failure isolation; metrics files; the mixed pair's cluster and plan files against the project's
loaders and validation; the flags its runs use; the checks' CPU-side arithmetic; and the whole
script in --cpu-only mode, where every GPU check reports SKIP."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from megatron_het.arguments import parse_run_config
from megatron_het.cluster import ClusterSpec
from megatron_het.cluster.accelerators import AcceleratorRegistry
from megatron_het.errors import UserError
from megatron_het.parallel.plan_validation import validate
from megatron_het.perf.measure.profile_format import LayerEntry
from tools.gpu_check import cli, mfu, mixed_pair, profile_check, runner
from tools.gpu_check.context import CheckContext, Options
from tools.gpu_check.device_checks import (
    fused_loss_errors,
    max_rel_error,
    sdpa_usable,
    tiny_loss_and_grads,
)
from tools.gpu_check.metrics_file import compare_losses, losses, median_field, train_records
from tools.gpu_check.pair_files import (
    CLUSTER_FILE,
    GLOBAL_BATCH,
    load_and_validate,
    pair_files,
)
from tools.gpu_check.relay_check import relay_round_trip
from tools.gpu_check.report import (
    FAIL,
    PASS,
    SKIP,
    Row,
    RowWriter,
    all_passed,
    format_table,
    read_rows,
    write_summary,
)
from tools.gpu_check.runner import Check, run_checks, run_command

REPO = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable


def ctx_at(tmp_path: pathlib.Path, **options: object) -> CheckContext:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return CheckContext(
        RowWriter(tmp_path / "rows.jsonl"), tmp_path, time.monotonic() + 60, Options(**options)
    )


# ---- rows, table, summary --------------------------------------------------------------------
def test_rows_round_trip_through_the_rows_file_and_a_cut_line_is_dropped(tmp_path):
    writer = RowWriter(tmp_path / "rows.jsonl")
    writer.add("a.one", PASS, 0.000123456, "<= 1e-4", figures=[1.0, float("nan")])
    writer.add("a.two", FAIL, "broke", path=tmp_path)
    with open(tmp_path / "rows.jsonl", "a") as handle:
        handle.write('{"check": "a.three", "stat')  # a check killed mid-write
    rows = read_rows(tmp_path / "rows.jsonl")
    assert [(r.check, r.status, r.value) for r in rows] == [
        ("a.one", PASS, "0.0001235"),
        ("a.two", FAIL, "broke"),
    ]
    assert rows[0].details["figures"] == [1.0, "nan"] and rows[1].details["path"] == str(tmp_path)
    assert read_rows(tmp_path / "absent.jsonl") == []


def test_a_row_refuses_an_unknown_status():
    with pytest.raises(ValueError, match="status"):
        Row("x", "OK")


def test_table_aligns_columns_and_clips_long_values():
    rows = [Row("probe.torch", PASS, "torch 2.x", "CUDA"), Row("m", FAIL, "v" * 300, "t")]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["check", "status", "value", "threshold"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].index("PASS") == lines[3].index("FAIL") == lines[0].index("status")
    assert "..." in lines[3] and len(lines[3]) < 200


def test_summary_json_counts_statuses_and_skip_is_not_a_failure(tmp_path):
    rows = [Row("a", PASS), Row("b", SKIP, "no CUDA device")]
    path = write_summary(tmp_path / "out", rows, {"host": "h", "elapsed_s": 1.5})
    data = json.loads(path.read_text())
    assert data["all_passed"] is True and data["counts"] == {PASS: 1, FAIL: 0, SKIP: 1}
    assert data["host"] == "h" and [r["check"] for r in data["rows"]] == ["a", "b"]
    assert (tmp_path / "out" / "gpu_check_table.txt").read_text().startswith("check")
    assert not all_passed(rows + [Row("c", FAIL)])


# ---- runner: timeouts and failure isolation --------------------------------------------------
def _script(code: str) -> tuple[str, ...]:
    """A check command: Python code that gets --rows FILE --work DIR --budget S as argv."""
    prelude = (
        "import json, sys, time, os, signal\n"
        "rows = sys.argv[sys.argv.index('--rows') + 1]\n"
        "def row(name, status):\n"
        "    open(rows, 'a').write(json.dumps({'check': name, 'status': status}) + '\\n')\n"
    )
    return (PY, "-c", prelude + code)


@pytest.mark.slow
def test_a_hanging_or_crashing_check_does_not_stop_the_others(tmp_path):
    checks = [
        Check("hangs", 1.5, _script("row('hangs.first', 'PASS'); time.sleep(60)")),
        Check("crashes", 10, _script("row('crashes.part', 'PASS'); sys.exit(3)")),
        Check("silent", 10, _script("pass")),
        Check("fine", 10, _script("row('fine.one', 'PASS')")),
    ]
    start = time.monotonic()
    rows, runs = run_checks(checks, tmp_path, deadline_s=60)
    assert time.monotonic() - start < 30
    got = [(r.check, r.status) for r in rows]
    assert got == [
        ("hangs.first", PASS),
        ("hangs", FAIL),
        ("crashes.part", PASS),
        ("crashes", FAIL),
        ("silent", FAIL),
        ("fine.one", PASS),
    ]
    by_name = {r.check: r for r in rows}
    assert by_name["hangs"].value.startswith("timed out") and "1 rows" in by_name["hangs"].value
    assert "status 3" in by_name["crashes"].value
    assert by_name["silent"].value == "reported no result"
    assert [run.timed_out for run in runs] == [True, False, False, False]


@pytest.mark.slow
def test_checks_past_the_deadline_are_skipped_not_started(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "MIN_START_S", 0.5)
    checks = [Check("slow", 60, _script("time.sleep(60)")), Check("late", 10, _script("pass"))]
    rows, runs = run_checks(checks, tmp_path, deadline_s=1.5)
    assert [(r.check, r.status) for r in rows] == [("slow", FAIL), ("late", SKIP)]
    assert [run.name for run in runs] == ["slow"] and "budget is spent" in rows[1].value


def test_the_results_so_far_are_handed_over_after_every_check(tmp_path):
    """So the script can rewrite its summary after each check: a run killed from outside
    still leaves the rows of the checks that finished."""
    seen = []
    checks = [
        Check("one", 10, _script("row('one.a', 'PASS')")),
        Check("two", 10, _script("row('two.a', 'FAIL')")),
    ]
    run_checks(
        checks,
        tmp_path,
        deadline_s=60,
        after_each=lambda rows, runs: seen.append(
            ([r.check for r in rows], [run.name for run in runs])
        ),
    )
    assert seen == [(["one.a"], ["one"]), (["one.a", "two.a"], ["one", "two"])]


def test_a_check_is_told_its_budget_and_where_to_write(tmp_path):
    code = (
        "budget = float(sys.argv[sys.argv.index('--budget') + 1])\n"
        "row('told.%g' % budget, 'PASS')\n"
        "assert os.path.isdir(sys.argv[sys.argv.index('--work') + 1])\n"
    )
    checks = [Check("told", 7, _script(code))]
    rows, _ = run_checks(checks, tmp_path, deadline_s=60)
    assert [r.check for r in rows] == ["told.7"]


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.slow
def test_a_command_ignoring_sigterm_is_killed_and_so_are_its_leftovers(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    result = run_command([PY, "-c", code], 2.0, tmp_path / "log.txt", grace_s=0.5)
    assert result.timed_out and not result.ok and result.seconds < 10
    assert "timed out" in result.why()
    child = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.slow
def test_a_timed_out_command_takes_its_own_session_children_along(tmp_path):
    # As torchrun does: a worker in a session of its own, which a signal to the launcher's
    # session does not reach.
    pid_file = tmp_path / "worker.pid"
    code = (
        "import subprocess, sys, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(worker.pid))\n"
        "time.sleep(60)\n"
    )
    result = run_command([PY, "-c", code], 2.0, tmp_path / "log.txt", grace_s=0.5)
    assert result.timed_out
    worker = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(worker):
            break
        time.sleep(0.1)
    assert not _alive(worker)


def test_descendants_finds_children_and_grandchildren():
    child = subprocess.Popen(
        [
            PY,
            "-c",
            "import subprocess, sys, time; subprocess.Popen("
            "[sys.executable, '-c', 'import time; time.sleep(30)']); "
            "time.sleep(30)",
        ]
    )
    try:
        for _ in range(100):
            found = runner.descendants(os.getpid())
            if len(found) >= 2:
                break
            time.sleep(0.05)
        assert child.pid in found and len(found - {child.pid}) >= 1
    finally:
        for pid in runner.descendants(child.pid) | {child.pid}:
            os.kill(pid, 9)
        child.wait()


def test_run_command_logs_the_command_and_its_output(tmp_path):
    result = run_command(
        [PY, "-c", "print('hello'); raise SystemExit(4)"], 30, tmp_path / "log.txt"
    )
    assert result.returncode == 4 and not result.timed_out and "status 4" in result.why()
    assert "hello" in result.tail() and result.tail().startswith("$ ")
    missing = run_command([str(tmp_path / "no-such-program")], 5, tmp_path / "log2.txt")
    assert missing.returncode is None and missing.why() == "could not be started"


# ---- metrics files ---------------------------------------------------------------------------
def _metrics(path: pathlib.Path, lines: list) -> pathlib.Path:
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return path


def test_train_records_keep_train_lines_in_order_and_the_later_duplicate(tmp_path):
    path = _metrics(
        tmp_path / "m.jsonl",
        [
            {"split": "train", "iteration": 2, "loss": 5.0, "mfu": 0.2},
            {"split": "valid", "iteration": 2, "loss": 9.0},
            {"split": "train", "iteration": 1, "loss": 6.0, "mfu": 0.1},
            {"split": "train", "iteration": 2, "loss": 4.0, "mfu": 0.4},
            '{"split": "train", "iter',
        ],
    )
    assert [r["iteration"] for r in train_records(path)] == [1, 2]
    assert losses(path) == {1: 6.0, 2: 4.0}
    assert median_field(train_records(path), "mfu", skip_first=1) == 0.4
    assert median_field(train_records(path), "mfu", skip_first=5) == pytest.approx(0.25)
    assert median_field(train_records(path), "absent") is None
    assert train_records(tmp_path / "none.jsonl") == []


def test_compare_losses_relative_missing_exact_and_non_finite():
    ref = {1: 10.0, 2: 8.0, 3: 6.0}
    close = compare_losses({1: 10.0, 2: 8.0004, 3: 6.0}, ref)
    assert close.max_rel == pytest.approx(5e-5) and close.within(1e-4) and not close.within(1e-5)
    assert not close.exact and "3 iterations" in close.describe()
    exact = compare_losses(dict(ref), ref)
    assert exact.exact and exact.within(0.0) and "bitwise" in exact.describe()
    short = compare_losses({1: 10.0, 2: 8.0}, ref)
    assert short.missing == (3,) and not short.within(1.0)
    assert not compare_losses({1: float("nan"), 2: 8.0, 3: 6.0}, ref).within(1.0)
    assert compare_losses({}, ref).max_rel == math.inf and not compare_losses({}, {}).within(1.0)


# ---- the mixed pair's files and flags --------------------------------------------------------
def test_pair_cluster_places_the_h200_and_the_cpu_on_one_node():
    cluster = ClusterSpec.load(CLUSTER_FILE)
    ranks = cluster.rank_map()
    assert [(r.accelerator.name, r.node, r.local_rank) for r in ranks] == [
        ("H200", 0, 0),
        ("cpu", 0, 1),
    ]
    assert cluster.uniform_nproc_per_node == 2  # torchrun --nproc_per_node 2 on one node
    assert not any(r.accelerator.emulated for r in ranks)


def test_pair_plans_validate_against_the_model_cluster_and_batch(tmp_path):
    files = pair_files("H200", tmp_path)
    model = mixed_pair.pair_model_config()
    cluster, pp, dp = load_and_validate(files, model)
    stages = pp.pipelines[0].stages
    assert [(s.accelerator, s.has_embedding, s.has_head) for s in stages] == [
        ("H200", True, False),
        ("cpu", False, True),
    ]
    assert stages[0].layers[0] == 0 and stages[-1].layers[1] == model.num_layers
    assert [(p.stages[0].accelerator, p.stages[0].layers) for p in dp.pipelines] == [
        ("H200", (0, model.num_layers)),
        ("cpu", (0, model.num_layers)),
    ]
    assert pp.global_batch_size == dp.global_batch_size == GLOBAL_BATCH
    with pytest.raises(UserError):  # validation is real: a wrong batch is refused
        validate(pp, model, cluster, GLOBAL_BATCH * 2)


def test_pair_files_for_a_cpu_first_rank_are_rewritten_and_still_valid(tmp_path):
    files = pair_files("cpu", tmp_path / "files")
    assert files.cluster.parent == tmp_path / "files"
    cluster, pp, dp = load_and_validate(files, mixed_pair.pair_model_config())
    assert {r.accelerator.name for r in cluster.rank_map()} == {"cpu"}
    kinds = {s.accelerator for plan in (pp, dp) for p in plan.pipelines for s in p.stages}
    assert kinds == {"cpu"}


@pytest.mark.parametrize(
    "extra",
    [
        ["--micro-batch-size", "2", "--global-batch-size", "8"],
        [
            "--cluster",
            str(CLUSTER_FILE),
            "--plan",
            "P",
            "--save",
            "c",
            "--save-interval",
            "4",
            "--exit-interval",
            "4",
            "--load",
            "c",
            "--metrics-file",
            "m.jsonl",
        ],
        [
            "--cluster",
            str(CLUSTER_FILE),
            "--plan",
            "P",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
        ],
    ],
)
def test_the_pair_runs_use_flags_that_pretrain_llama_has(extra):
    run = parse_run_config([*mixed_pair.MODEL_FLAGS, *mixed_pair.TRAIN_FLAGS, *extra])
    assert run.train.train_iters == 2 * mixed_pair.HALF


def test_the_mfu_run_is_a_1b_llama_with_flags_that_pretrain_llama_has(tmp_path):
    from megatron_het.arguments import resolve_model_config
    from megatron_het.data.tokenizer import build_tokenizer

    run = parse_run_config(mfu.train_flags(4, 10, tmp_path / "m.jsonl"))
    data = run.data
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_size)
    config = resolve_model_config(run.model, tokenizer.vocab_size, data.seq_length)
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (22, 2048, 5632)
    assert (config.num_attention_heads, config.num_query_groups) == (16, 4)
    assert 1.0e9 < config.num_parameters() < 1.2e9
    assert run.train.global_batch_size == 4 * mfu.MICRO_BATCHES and data.seq_length == 2048


def test_the_profile_run_uses_flags_that_profile_device_has(tmp_path):
    from tools import profile_device as tool

    args = tool.build_parser().parse_args(
        [
            *profile_check.SHAPE_FLAGS,
            *profile_check.SWEEP_FLAGS,
            "--device",
            "cuda",
            "--out",
            str(tmp_path),
        ]
    )
    assert args.seq_lengths == (2048,) and args.dtype == "bf16" and not args.compile
    args = tool.build_parser().parse_args(
        [
            *profile_check.SHAPE_FLAGS,
            *profile_check.COMPILED_FLAGS,
            "--device",
            "cuda",
            "--out",
            str(tmp_path),
        ]
    )
    assert args.compile and args.micro_batch_sizes == (4,) and args.warmup >= 1


def test_the_bench_run_uses_flags_that_the_bench_has():
    from bench import train_step as bench
    from tools.gpu_check import bench_check

    flags = [f for f in bench_check.BENCH_FLAGS if f != "cuda"]
    flags[flags.index("--device") : flags.index("--device") + 1] = ["--device", "cpu"]
    args = bench.parse_args(flags)  # on the CPU: parsing refuses --device cuda without a GPU
    assert args.compile and args.dtype == "bf16" and args.seq_length == 2048
    assert (
        args.config.num_layers,
        args.config.hidden_size,
        args.config.ffn_hidden_size,
        args.config.num_attention_heads,
        args.config.num_query_groups,
    ) == (4, 2048, 5632, 16, 4)
    record = {
        "ratio_vs_hf": 1.62,
        "ours_tokens_per_s": 81234.5,
        "hf_tokens_per_s": 50111.0,
        "dtype": "bf16",
        "config": {"num_layers": 4},
        "micro_batch_size": 4,
        "seq_length": 2048,
        "compile_s": 21.4,
    }
    text = "compiling...\n" + json.dumps(record) + "\n"
    assert bench_check.last_json_line(text) == record
    assert bench_check.last_json_line("no record\n[1, 2]\n") is None
    assert bench_check.bench_value(record) == (
        "ratio_vs_hf 1.62: ours 81,234 tokens/s, HF "
        "50,111 (bf16, 4 layers, mb 4 x seq 2048, "
        "compile 21 s)"
    )


# ---- the checks' arithmetic, on the CPU ------------------------------------------------------
def test_fused_loss_errors_are_small_for_fp32_and_bf16_on_the_cpu():
    loss_rel, grad_rel = fused_loss_errors("cpu", torch.float32, tokens=128, vocab=1000)
    assert loss_rel < 1e-5 and grad_rel < 1e-4
    loss_rel, grad_rel = fused_loss_errors("cpu", torch.bfloat16, tokens=128, vocab=1000)
    assert loss_rel < 1e-3 and grad_rel < 2e-2


@pytest.mark.parametrize("tp", [2, 4])
def test_the_tp_rings_as_threads_match_the_whole_products_on_the_cpu(tp, monkeypatch):
    from megatron_het.tensor_parallel import comm_overlap
    from tools.gpu_check import tp_rings

    assert tp_rings.ring_errors("cpu", torch.float32, tp=tp) < 1e-5
    assert tp_rings.ring_errors("cpu", torch.bfloat16, tp=tp) < 2e-2
    # A reduce-scatter ring that sums the wrong blocks is caught.
    monkeypatch.setattr(
        comm_overlap._Ring, "block", lambda self, step, behind=0: (self.rank - step) % self.size
    )
    assert tp_rings.ring_errors("cpu", torch.float32, tp=tp) > 0.1


def test_thread_ranks_run_their_backward_on_their_own_thread():
    """On CUDA autograd would run both ranks' backward on one device thread, where a ring's
    backward waiting for its peer deadlocks; the ranks turn that off for themselves."""
    from tools.gpu_check.tp_rings import ThreadRing

    seen = ThreadRing(2).run(lambda member: torch.autograd.is_multithreading_enabled())
    assert seen == [False, False]
    assert torch.autograd.is_multithreading_enabled()


def test_a_thread_rank_that_fails_is_named():
    from tools.gpu_check.tp_rings import ThreadRing

    def work(member):
        if member.rank == 1:
            raise ValueError("boom")
        return member.rank

    with pytest.raises(RuntimeError, match="TP ring rank 1 failed: boom"):
        ThreadRing(2).run(work)


def test_tiny_model_bf16_parameters_stay_within_the_bf16_threshold():
    loss32, grads32 = tiny_loss_and_grads("cpu", torch.float32)
    loss16, grads16 = tiny_loss_and_grads("cpu", torch.bfloat16)
    assert abs(loss16 - loss32) / loss32 < 2e-2
    assert 0 < max(max_rel_error(grads16[n], grads32[n]) for n in grads32) < 0.1


def test_sdpa_probe_reports_a_usable_and_an_unusable_backend_on_the_cpu():
    ok, value, details = sdpa_usable("flash", "cpu", seq=64)  # torch's CPU flash kernel
    assert ok and 0 < details["mha"] < 2e-2 and "gqa" in value
    ok, value, details = sdpa_usable("mem_efficient", "cpu", seq=64)  # CUDA only
    assert not ok and value.startswith("mha unusable")


def test_max_rel_error_is_relative_to_the_largest_value():
    assert max_rel_error(torch.tensor([1.0, 2.01]), torch.tensor([1.0, 2.0])) == pytest.approx(
        0.005
    )


def test_relay_round_trip_brings_the_data_back_through_the_host():
    intact, gbps = relay_round_trip("cpu", nbytes=1 << 22, rounds=1)  # several chunks
    assert intact and gbps > 0


def test_roofline_row_compares_a_layer_with_the_peak_and_the_estimate():
    entry = LayerEntry(
        2048,
        5632,
        16,
        4,
        2048,
        4,
        1,
        "bf16",
        forward_s=0.004,
        backward_s=0.009,
        activation_bytes=1e9,
    )
    name, value, details = profile_check.roofline_row(
        entry, AcceleratorRegistry.builtin().get("H200")
    )
    assert name == "profile.layer.s2048-b4-tp1"
    roof = details["roofline_forward_s"]
    assert 0 < roof < details["predicted_forward_s"] < entry.forward_s
    assert f"{roof / entry.forward_s:.0%} of roofline" in value and "est.)" in value
    # the estimate is the predictor's for an eager run: H200 takes the calibrated H100
    # factors, with the eager layers' elementwise traffic (the tool measures eager layers)
    from megatron_het.perf.cost.calibration import efficiency_for
    from megatron_het.perf.cost.roofline import (
        EAGER_ELEMENTWISE_TRAFFIC,
        layer_forward_ops,
        ops_time,
    )

    spec = AcceleratorRegistry.builtin().get("H200")
    eager = dataclasses.replace(efficiency_for(spec), elementwise_traffic=EAGER_ELEMENTWISE_TRAFFIC)
    assert (
        details["predicted_forward_s"]
        == ops_time(layer_forward_ops(entry.shape()), spec, "bf16", eager)[0]
    )
    assert efficiency_for(spec).gemm < 0.6  # not the uncalibrated default
    # a compiled entry: its own row, against the estimate for compiled (fused) layers
    compiled = dataclasses.replace(entry, compiled=True)
    name, _, details = profile_check.roofline_row(compiled, spec)
    assert name == "profile.layer.s2048-b4-tp1.compiled" and details["compiled"]
    assert (
        details["predicted_forward_s"]
        == ops_time(layer_forward_ops(entry.shape()), spec, "bf16", efficiency_for(spec))[0]
    )


def _mfu_rows(
    tmp_path: pathlib.Path,
    mfu_value: float,
    peak: float,
    step_s: float = 1.0,
    variant: str = "compile",
) -> dict[str, Row]:
    ctx = ctx_at(tmp_path)
    records = [
        {
            "iteration": i,
            "mfu": 0.01 if i <= mfu.WARMUP_ITERS else mfu_value,
            "iteration_time_s": 9.0 if i <= mfu.WARMUP_ITERS else step_s,
            "tokens_per_s": 5e4,
            "tflops_per_device": 400.0,
        }
        for i in range(1, 8)
    ]
    result = {
        "accelerator": "H200",
        "peak_bytes": peak,
        "peak_reserved_bytes": peak * 1.1,
        "predicted_peak_bytes": 30 * 2**30,
        "predicted_mfu": 0.52,
        "predicted_iteration_s": 1.1,
    }
    mfu._report(ctx, variant, 4, [4], records, result)
    return {r.check: r for r in ctx.rows.rows}


def test_mfu_rows_use_the_median_after_warm_up_and_the_thresholds(tmp_path):
    good = _mfu_rows(tmp_path / "a", 0.45, 33 * 2**30)
    assert good["mfu.compile"].status == PASS and good["mfu.compile"].value.startswith("45.0%")
    assert good["mfu.compile.memory"].status == PASS
    assert "x1.10" in good["mfu.compile.memory"].value
    assert good["mfu.compile.step"].status == PASS
    assert good["mfu.compile.step"].value == "measured 1.000 s vs predicted 1.100 s (+10.0%)"
    bad = _mfu_rows(tmp_path / "b", 0.30, 45 * 2**30, step_s=0.8)
    assert bad["mfu.compile"].status == FAIL and bad["mfu.compile.memory"].status == FAIL
    assert bad["mfu.compile.step"].status == FAIL
    assert "(+37.5%)" in bad["mfu.compile.step"].value
    # the eager run (fused csrc kernels) is held to its own target, 45%
    eager = _mfu_rows(tmp_path / "c", 0.30, 45 * 2**30, step_s=0.8, variant="eager")
    assert eager["mfu.eager"].status == FAIL and eager["mfu.eager"].value.startswith("30.0%")
    assert "(eager: csrc kernels)" in eager["mfu.eager"].threshold
    assert eager["mfu.eager.memory"].status == FAIL and eager["mfu.eager.step"].status == FAIL
    fast = _mfu_rows(tmp_path / "d", 0.46, 33 * 2**30, variant="eager")
    assert fast["mfu.eager"].status == PASS


@pytest.mark.parametrize(
    "extra, runs",
    [
        ((), [("eager", ()), ("compile", ("--compile",))]),
        (
            ("--recompute-activations",),
            [
                ("eager", ("--recompute-activations",)),
                ("compile", ("--recompute-activations", "--compile")),
            ],
        ),
        (("--compile",), [("compile", ("--compile",))]),
    ],
)
def test_mfu_runs_eager_and_compiled_unless_asked_to_compile(extra, runs):
    assert mfu.variants(extra) == runs


# ---- the checks' control flow, with fake sub-runs -------------------------------------------
def _fake_runs(ctx: CheckContext, outcome):
    """Replace ``ctx.run``: ``outcome(name, argv)`` returns (returncode, timed_out) and may write
    the run's files; the log name's stem is the run's name."""

    def run(argv, wanted_s, log_name, env=None):
        name = log_name.rsplit(".", 1)[0]
        code, timed_out = outcome(name, list(argv))
        (ctx.work / log_name).write_text(f"fake {name}\n")
        return runner.CommandResult(code, timed_out, 0.1, ctx.work / log_name)

    ctx.run = run


def _flag(argv: list, name: str) -> str:
    return argv[argv.index(name) + 1]


def _pair_rows(tmp_path, monkeypatch, cpu_off: float, pp_off: float, seen: list) -> dict:
    """The mixed check's rows with the CPU reference ``cpu_off`` and the pp runs ``pp_off``
    (relative) off the GPU run's losses; the dp run hangs. ``seen``: the rows out before it."""
    monkeypatch.setattr(mixed_pair.torch.cuda, "is_available", lambda: True)
    ctx = ctx_at(tmp_path)
    ref = {i: 8.0 - 0.01 * i for i in range(1, 9)}

    def outcome(name, argv):
        if name == "dp":
            seen.extend(r.check for r in ctx.rows.rows)
            return None, True  # hangs and is killed
        metrics = pathlib.Path(_flag(argv, "--metrics-file"))
        first = 5 if "--load" in argv else 1
        last = 4 if "--exit-interval" in argv else 8
        scale = 1 + (cpu_off if name == "ref_cpu" else pp_off if name.startswith("pp") else 0)
        with open(metrics, "a") as handle:
            for i in range(first, last + 1):
                handle.write(
                    json.dumps({"split": "train", "iteration": i, "loss": ref[i] * scale}) + "\n"
                )
        return 0, False

    _fake_runs(ctx, outcome)
    mixed_pair.check_mixed_pair(ctx)
    return {r.check: r for r in ctx.rows.rows}


def test_mixed_pair_reports_each_comparison_and_names_the_run_that_failed(tmp_path, monkeypatch):
    rows_before_dp: list = []
    rows = _pair_rows(tmp_path, monkeypatch, 3e-4, 2e-5, rows_before_dp)
    assert rows["mixed.files"].status == PASS
    assert rows["mixed.reference"].status == FAIL  # 3e-4 apart: over 1e-4
    assert rows["mixed.pp"].status == PASS and "2.00e-05" in rows["mixed.pp"].value
    assert rows["mixed.resume"].status == PASS and "bitwise" in rows["mixed.resume"].value
    assert rows["mixed.dp"].status == FAIL and rows["mixed.dp"].value == "dp timed out after 0 s"
    # The first wave's rows are out before the second wave runs.
    assert rows_before_dp == ["mixed.files", "mixed.reference", "mixed.pp"]


@pytest.mark.parametrize(
    "cpu_off, status, threshold",
    [
        (3e-4, PASS, "<= 0.0006 rel"),  # the CPU floor fails mixed.reference alone
        (1e-5, FAIL, "<= 0.0001 rel"),
    ],
)
def test_the_pair_is_held_to_twice_the_gpu_vs_cpu_floor_where_it_is_over_the_tolerance(
    tmp_path, monkeypatch, cpu_off, status, threshold
):
    rows = _pair_rows(tmp_path, monkeypatch, cpu_off, 5e-4, [])
    assert (rows["mixed.pp"].status, rows["mixed.pp"].threshold) == (status, threshold)


def test_mixed_pair_resume_is_not_run_when_the_first_half_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(mixed_pair.torch.cuda, "is_available", lambda: True)
    ctx = ctx_at(tmp_path)
    started = []

    def outcome(name, argv):
        started.append(name)
        return (1, False) if name == "pp_half" else (0, False)

    _fake_runs(ctx, outcome)
    mixed_pair.check_mixed_pair(ctx)
    rows = {r.check: r for r in ctx.rows.rows}
    assert "pp_resume" not in started and rows["mixed.resume"].value.startswith("pp_half exited")
    assert rows["mixed.pp"].status == FAIL and "no iterations" in rows["mixed.pp"].value


def test_mfu_halves_the_micro_batch_after_out_of_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(mfu.torch.cuda, "is_available", lambda: True)
    ctx = ctx_at(tmp_path)

    def outcome(name, argv):
        result = pathlib.Path(_flag(argv, "--result"))
        micro = int(_flag(argv, "--micro-batch-size"))
        if micro == 4:
            result.write_text(json.dumps({"accelerator": "H200", "oom": "CUDA out of memory"}))
            return 3, False
        with open(_flag(argv, "--metrics-file"), "w") as handle:
            for i in range(1, 6):
                handle.write(
                    json.dumps(
                        {
                            "split": "train",
                            "iteration": i,
                            "mfu": 0.46,
                            "tokens_per_s": 5e4,
                            "tflops_per_device": 415,
                        }
                    )
                    + "\n"
                )
        result.write_text(
            json.dumps(
                {
                    "accelerator": "H200",
                    "peak_bytes": 20 * 2**30,
                    "peak_reserved_bytes": 22 * 2**30,
                    "predicted_peak_bytes": 21 * 2**30,
                    "flags": argv[argv.index("--") + 1 :],
                }
            )
        )
        return 0, False

    _fake_runs(ctx, outcome)
    mfu.check_mfu(ctx)
    rows = {r.check: r for r in ctx.rows.rows}
    for variant in ("eager", "compile"):
        assert rows[f"mfu.{variant}"].status == PASS
        assert rows[f"mfu.{variant}"].details["tried"] == [4, 2]
        assert "micro-batch 2 x 4" in rows[f"mfu.{variant}"].value
        assert rows[f"mfu.{variant}.memory"].status == PASS
    assert "--compile" in rows["mfu.compile"].details["flags"]
    assert "--compile" not in rows["mfu.eager"].details["flags"]


# ---- the command line and the whole script ---------------------------------------------------
def test_cli_refuses_unknown_checks_and_bad_options():
    with pytest.raises(UserError, match="unknown check 'gpus'"):
        cli.selected_checks("probe,gpus")
    assert cli.selected_checks("mfu, probe") == ["mfu", "probe"]
    with pytest.raises(UserError):
        cli.options_of(cli.build_parser().parse_args(["--mfu-micro-batch", "0"]))
    args = cli.build_parser().parse_args(["--mfu-flags=--compile --x 1", "--cpu-only"])
    assert cli.options_of(args).mfu_flags == ("--compile", "--x", "1")
    assert "--mfu-flags=--compile --x 1" in cli._option_argv(args)


def test_the_budgets_fit_in_eight_minutes():
    assert sum(budget for budget, _ in cli.CHECKS.values()) <= cli.DEADLINE_S < 8 * 60 - 10


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible to this process")
@pytest.mark.parametrize("name", list(cli.CHECKS))
def test_every_check_reports_skip_for_its_gpu_rows_without_a_device(tmp_path, name):
    ctx = ctx_at(tmp_path, cpu_only=True)
    module, function = cli.CHECKS[name][1].split(":")
    getattr(importlib.import_module(module), function)(ctx)
    statuses = {r.check: r.status for r in read_rows(tmp_path / "rows.jsonl")}
    assert statuses and all(c.startswith(name + ".") for c in statuses)
    if name == "mixed":
        assert statuses.pop("mixed.files") == PASS  # needs no GPU
    assert set(statuses.values()) == {SKIP}


@pytest.mark.slow
def test_the_script_in_cpu_only_mode_runs_each_check_in_its_own_process(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": PY}
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "gpu_check.sh"),
            "--cpu-only",
            "--only",
            "probe,mixed",
            "--work",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    statuses = {r["check"]: r["status"] for r in data["rows"]}
    assert {c.split(".")[0] for c in statuses} == {"probe", "mixed"}
    assert [c["name"] for c in data["checks"]] == ["probe", "mixed"]
    assert statuses.pop("mixed.files") == PASS  # needs no GPU
    assert set(statuses.values()) == {SKIP} and data["all_passed"] and data["cpu_only"]
    assert data["finished"]
    assert "check" in proc.stdout and (tmp_path / "out" / "gpu_check_logs.txt").exists()


def test_the_kernel_probe_names_the_gemm_and_attention_paths_training_takes(tmp_path):
    from tools.gpu_check.device_checks import _probe_kernels

    ctx = ctx_at(tmp_path)
    _probe_kernels(ctx, torch.device("cpu"))  # the CPU: no out_dtype GEMMs, the flash kernel
    rows = {r.check: r for r in ctx.rows.rows}
    assert rows["probe.gemm-fp32-out"].status == FAIL
    assert "fall back to float32" in rows["probe.gemm-fp32-out"].value
    assert rows["probe.attention"].status == PASS
    assert rows["probe.attention"].value.endswith("-> sdpa[FLASH_ATTENTION]")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible to this process")
@pytest.mark.parametrize("name", ["numerics", "mfu", "profile", "mixed", "bench"])
def test_a_check_without_a_device_fails_unless_the_gpu_was_hidden(tmp_path, name):
    ctx = ctx_at(tmp_path)  # no --cpu-only: a GPU host whose GPU torch cannot see
    module, function = cli.CHECKS[name][1].split(":")
    getattr(importlib.import_module(module), function)(ctx)
    rows = [r for r in read_rows(tmp_path / "rows.jsonl") if r.check != "mixed.files"]
    assert rows and all(r.status == FAIL and "a GPU was expected" in r.value for r in rows)


def test_out_of_memory_is_told_from_other_errors():
    assert mfu.is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried ..."))
    assert mfu.is_out_of_memory(
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    )
    assert not mfu.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access"))


def test_an_error_in_one_block_fails_its_rows_and_the_check_goes_on(tmp_path):
    from tools.gpu_check.device_checks import rows_or_fail

    ctx = ctx_at(tmp_path)
    with rows_or_fail(ctx, ("x.first", "x.second")):
        ctx.rows.add("x.first", PASS, "fine")
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    with rows_or_fail(ctx, ("x.third",)):
        ctx.rows.add("x.third", PASS, "still runs")
    rows = {r.check: r for r in read_rows(tmp_path / "rows.jsonl")}
    assert rows["x.first"].status == PASS and rows["x.third"].status == PASS
    assert rows["x.second"].status == FAIL and rows["x.second"].value == (
        "raised RuntimeError: CUDA error: an illegal memory access was encountered"
    )


def test_the_mode_ratio_row_pairs_eager_and_compiled_entries_of_one_shape():
    from megatron_het.perf.measure.profile_format import Profile, ProfileConditions

    spec = AcceleratorRegistry.builtin().get("H200")
    eager = LayerEntry(2048, 5632, 16, 4, 2048, 4, 1, "bf16", 0.004, 0.012, 1e9)
    other = dataclasses.replace(eager, micro_batch=1)
    compiled = dataclasses.replace(eager, forward_s=0.002, backward_s=0.009, compiled=True)
    profile = Profile(
        "H200", ProfileConditions("H200", "2.11", 16, "d"), layers=(eager, other, compiled)
    )
    assert profile_check.mode_pairs(profile) == [(eager, compiled)]
    name, value, details = profile_check.mode_ratio_row(eager, compiled, spec)
    assert name == "profile.mode-ratio.s2048-b4-tp1"
    assert details["measured"] == pytest.approx((0.5, 0.75)) and "fwd compiled/eager x0.50" in value
    assert all(0.2 < r < 1.0 for r in details["roofline"])  # fusion saves time in the model
