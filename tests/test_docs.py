"""README.md and docs/*.md stay true to the code.

- Every relative link points to an existing file, and to an existing heading where it has an
  ``#anchor`` (GitHub's heading slugs).
- Every command shown (lines of ```bash, ```sh and ```console blocks; inline code with
  arguments that starts with ``python``, ``pretrain_llama.py``, ``tools/``, ``make`` or
  ``bash scripts/``) is classified by :func:`classify`'s rules: TEMPLATE (placeholders, never
  run), LONG (never run here, with the reason) or RUN (finishes on a CPU in seconds). Each RUN
  command runs, in-process where it can, in a scratch directory that holds the repository's
  programs and the small inputs the commands name (:data:`INPUTS`), and must exit with status 0.
- Every flag shown exists: in a command, in the parser of the program the command runs; in
  prose and tables, in one of our programs' parsers or in :data:`OTHER_PROGRAM_FLAGS`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND_LANGUAGES = {"bash", "sh", "shell", "console"}
INLINE_PREFIXES = ("python", "pretrain_llama.py", "tools/", "make", "bash scripts/")
# What the scratch directory links from the repository, so commands run as from its root.
REPO_ENTRIES = ("pretrain_llama.py", "tools", "scripts", "bench")
# Flags of programs that are not ours, named in the docs (torchrun's come from its parser).
OTHER_PROGRAM_FLAGS = {
    "sbatch": {"--nodes", "--ntasks-per-node", "--exclusive", "--gpus-per-node", "--gres",
               "--no-kill", "--signal", "--job-name", "--partition", "--time", "--nodelist"},
    "srun": {"--nodes", "--ntasks", "--ntasks-per-node", "--het-group", "--kill-on-bad-exit",
             "--nodelist", "--export"},
    "pytest": {"--collect-only", "--durations", "--maxfail", "--last-failed", "--dist"},
    "pip": {"--no-deps", "--no-build-isolation", "--editable", "--upgrade", "--index-url"},
    "tensorboard": {"--logdir", "--port", "--bind_all"},
    "pretrain_gpt.py": {"--use-checkpoint-args", "--finetune", "--no-load-optim", "--no-load-rng",
                        "--dist-ckpt-optim-fully-reshardable", "--ckpt-convert-format",
                        "--override-opt_param-scheduler"},
}  # fmt: skip
# make variables whose value is another program's command line
MAKE_ARGUMENT_VARIABLES = {
    "DEMO_ARGS": "demo",
    "GPU_CHECK_ARGS": "gpu_check",
    "PYTEST_ARGS": "pytest",
}
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
# Angle brackets, "..." or an ALL-CAPS word as an argument (PATH, DIR, HF_DIR, C.yaml) mark a
# template; environment assignments (DRY_RUN=1) are not placeholders.
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.[a-z]+)?$")


@dataclass(frozen=True)
class Command:
    doc: str  # path relative to the repository
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class Call:
    """A command resolved: ``program`` is "pretrain", "launch", "gpu_check", "demo",
    "torchrun", "make", a tool's path ("tools/plan.py") or a module ("bench.faults");
    ``path`` is the file a script program runs."""

    env: dict[str, str]
    program: str
    args: list[str]
    path: str = ""


# ---- reading the docs -----------------------------------------------------------------------


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def scan(path: Path) -> tuple[list[Command], list[tuple[int, str]]]:
    """(commands, prose) of a page: prose is every line outside command blocks, inline
    commands taken out, with its line number."""
    commands: list[Command] = []
    prose: list[tuple[int, str]] = []
    fence, pending, start = None, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        if fence in COMMAND_LANGUAGES:
            if fence == "console" and not pending:
                if not stripped.startswith("$ "):
                    continue  # the command's output
                stripped = stripped[2:]
            if not pending and (not stripped or stripped.startswith("#")):
                continue
            start = start if pending else number
            pending += stripped[:-1] + " " if stripped.endswith("\\") else stripped
            if not stripped.endswith("\\"):
                commands.append(Command(_rel(path), start, pending.strip()))
                pending = ""
            continue
        if fence is None:
            for span in re.findall(r"`([^`]+)`", line):
                if span.startswith(INLINE_PREFIXES) and len(span.split()) > 1:
                    commands.append(Command(_rel(path), number, span))
                    line = line.replace(f"`{span}`", "")
        prose.append((number, line))
    return commands, prose


@functools.cache
def all_commands() -> tuple[Command, ...]:
    return tuple(command for path in DOCS for command in scan(path)[0])


# ---- what a command runs, and whether it runs here ------------------------------------------


def resolve(tokens: list[str]) -> Call:
    env: dict[str, str] = {}
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    head, rest = (tokens[0] if tokens else ""), tokens[1:]
    if head in ("python", "python3", ".venv/bin/python") and rest[:1] == ["-m"] and rest[1:]:
        modules = {"torch.distributed.run": "torchrun", "megatron_het.demo": "demo",
                   "megatron_het.launcher": "launch", "tools.gpu_check": "gpu_check",
                   "pytest": "pytest", "pip": "pip"}  # fmt: skip
        return Call(env, modules.get(rest[1], rest[1]), rest[2:])
    if head in ("python", "python3", ".venv/bin/python", "bash") and rest:
        head, rest = rest[0], rest[1:]
    head = head.removeprefix("./")
    if head == "pretrain_llama.py":
        return Call(env, "pretrain", rest, head)
    if head == "scripts/gpu_check.sh":
        return Call(env, "gpu_check", rest, head)
    if re.fullmatch(r"scripts/\w+/pretrain_llama_\w+\.sh", head):
        return Call(env, "launch", rest, head)
    return Call(env, head, rest, head)


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1] if flag in args[:-1] else ""


def classify(command: Command) -> tuple[str, str]:
    """(TEMPLATE | LONG | RUN | UNCLASSIFIED, why): the first rule that matches decides."""
    tokens = shlex.split(command.text, comments=True)
    call = resolve(list(tokens))
    program, args = call.program, call.args
    if any("<" in t or "..." in t or (PLACEHOLDER.match(t) and "=" not in t) for t in tokens):
        return "TEMPLATE", "placeholders"
    if program in ("make", "scripts/setup_env.sh"):
        return "LONG", "sets up the virtualenv, then runs for minutes"
    if program in ("torchrun", "sbatch", "srun", "tools/elastic_run.py", "tools/comm_bench.py"):
        return "LONG", "starts several processes, or needs Slurm"
    if program in OTHER_PROGRAM_FLAGS:
        return "LONG", "another program: installs, tests or serves"
    if "--help" in args:
        return "RUN", "--help"
    if program == "gpu_check":
        return "LONG", "needs a GPU (up to 8 minutes)"
    if program.startswith("bench.") or program == "demo":
        return "LONG", "a benchmark or the demo: minutes"
    if program == "launch":
        asked = {k for k, v in call.env.items() if v == "1"} & {"DRY_RUN", "PRINT_ONLY"}
        if asked or {"--dry-run", "--print-only"} & set(args):
            return "RUN", "a launch script's dry run or printed command"
        return "LONG", "launches a multi-node job"
    if program == "pretrain":
        if "--dry-run" in args:
            return "RUN", "--dry-run"
        if _value(args, "--model") == "tiny" and "--mock-data" in args:
            return "RUN", "trains the tiny preset on mock data, seconds"
        return "LONG", "trains"
    if program == "tools/plan.py":
        if "--evaluate" in args or "cpu_emulated" in _value(args, "--cluster"):
            return "RUN", "a prediction, or a search on the emulated cluster"
        return "LONG", "a search on a large cluster: tens of seconds"
    if program == "tools/testnet.py":
        if args[:1] == ["plan"]:
            return "RUN", "prints a test network's plan"
        return "LONG", "builds or removes network namespaces (root)"
    if program == "megatron_het.kernels":
        return "RUN", "prints which implementation each fused op has here"
    if program == "tools/compile_kernels.py":
        return "LONG", "compiles the device sources: tens of seconds where not cached"
    if program in ("tools/checkpoint_info.py", "tools/convert_checkpoint.py",
                   "tools/preprocess_data.py", "tools/profile_device.py",
                   "tools/trace_report.py"):  # fmt: skip
        return "RUN", "a tool on the small inputs this test prepares"
    return "UNCLASSIFIED", f"no rule for {program!r}: add one to classify()"


def is_slow(command: Command) -> bool:
    """Over a few seconds: a subprocess, training (or inputs made by training), a search, a
    profile, tokenizer workers."""
    tokens = shlex.split(command.text, comments=True)
    call = resolve(list(tokens))
    if "--help" in call.args:
        return False
    return (
        call.program in ("launch", "tools/profile_device.py", "tools/preprocess_data.py")
        or bool(inputs_read(tokens))
        or call.program in ("pretrain", "tools/plan.py")
        and not {"--dry-run", "--evaluate"} & set(call.args)
    )


# ---- the programs' flags --------------------------------------------------------------------


class _Captured(BaseException):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _options(parser: argparse.ArgumentParser) -> frozenset[str]:
    return frozenset(o for action in parser._actions for o in action.option_strings)


def _captured_flags(run: Callable[[], object]) -> frozenset[str]:
    """The options of the first parser ``run`` parses with; for a program that parses by
    hand, the flags its usage error names."""

    def grab(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Captured(self)

    text = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", grab), \
            contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):  # fmt: skip
        try:
            run()
        except _Captured as captured:
            return _options(captured.parser)
        except SystemExit:
            pass
    return frozenset(FLAG.findall(text.getvalue()))


def _run_path(path: Path, argv: list[str]) -> None:
    with mock.patch.object(sys, "argv", [str(path), *argv]):
        runpy.run_path(str(path), run_name="__main__")


def _run_module(module: str, argv: list[str]) -> None:
    with mock.patch.object(sys, "argv", [module, *argv]):
        runpy.run_module(module, run_name="__main__", alter_sys=True)


@functools.cache
def program_flags(program: str) -> frozenset[str]:
    if program == "pretrain":
        from megatron_het.arguments import build_parser

        return _options(build_parser())
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        return _options(get_args_parser())
    if program == "launch":  # a launch script runs `python -m MODULE MIX "$@"`; the flags its
        # module does not know go to pretrain_llama.py
        script = next(iter(sorted(REPO.glob("scripts/*/pretrain_llama_*.sh"))))
        found = re.search(r" -m ([\w.]+) (\S+)", script.read_text(encoding="utf-8"))
        assert found, f"{_rel(script)} no longer runs `python -m MODULE MIX`: update this test"
        module, mix = found.groups()
        own = _captured_flags(lambda: _run_module(module, [str(REPO / mix), "--help"]))
        return own | program_flags("pretrain")
    if program in OTHER_PROGRAM_FLAGS:
        return frozenset(OTHER_PROGRAM_FLAGS[program])
    if program.startswith("tools/") and (REPO / program).is_file():
        return _captured_flags(lambda: _run_path(REPO / program, ["--help"]))
    module = {"demo": "megatron_het.demo", "gpu_check": "tools.gpu_check"}.get(program, program)
    if module.startswith(("bench.", "megatron_het.")) or module == "tools.gpu_check":
        return _captured_flags(lambda: _run_module(module, ["--help"]))
    return frozenset()


@functools.cache
def our_flags() -> frozenset[str]:
    """Every flag of every program of ours and of torchrun: prose may name any of them."""
    programs = ["pretrain", "launch", "demo", "gpu_check", "torchrun"]
    programs += [_rel(p) for p in sorted((REPO / "tools").glob("*.py")) if p.stem != "__init__"]
    programs += [
        f"bench.{p.stem}"
        for p in sorted((REPO / "bench").glob("[!_]*.py"))
        if '__name__ == "__main__"' in p.read_text(encoding="utf-8")
    ]  # (the others are the benchmarks' helpers)
    return frozenset().union(*(program_flags(p) for p in programs))


def _flags_of(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and a != "--"]


def command_flags(call: Call) -> Iterator[tuple[str, str]]:
    """(flag, program whose parser must have it) for every flag of a resolved command."""
    args = call.args
    if call.program in ("torchrun", "sbatch", "srun"):  # options, then a script and its own
        script = next((i for i, a in enumerate(args) if a.endswith((".py", ".sh"))), len(args))
        yield from ((f, call.program) for f in _flags_of(args[:script]))
        if script < len(args):
            yield from command_flags(resolve(args[script:]))
    elif call.program == "tools/elastic_run.py" and "--" in args:
        split = args.index("--")
        yield from ((f, call.program) for f in _flags_of(args[:split]))
        yield from ((f, "pretrain") for f in _flags_of(args[split + 1 :]))
    elif call.program == "tools/testnet.py" and "--" in args:  # its own, then a node's command
        split = args.index("--")
        yield from ((f, call.program) for f in _flags_of(args[:split]))
        yield from command_flags(resolve(args[split + 1 :]))
    elif call.program == "make":
        for name, _, value in (arg.partition("=") for arg in args):
            if name in MAKE_ARGUMENT_VARIABLES:
                target = MAKE_ARGUMENT_VARIABLES[name]
                yield from ((f, target) for f in _flags_of(shlex.split(value)))
    else:
        yield from ((f, call.program) for f in _flags_of(args))


def flag_problems(path: Path) -> list[str]:
    commands, prose = scan(path)
    problems = []
    for command in commands:
        call = resolve(shlex.split(command.text, comments=True))
        for flag, program in command_flags(call):
            if flag not in program_flags(program):
                problems.append(f"{command.where}: {flag} is not a flag of {program}")
    for number, line in prose:
        for flag in FLAG.findall(line):
            if flag not in our_flags() and not any(flag in f for f in OTHER_PROGRAM_FLAGS.values()):
                problems.append(f"{_rel(path)}:{number}: {flag} is no program's flag")
    return problems


# ---- links ------------------------------------------------------------------------------------


def _outside_fences(text: str) -> Iterator[tuple[int, str]]:
    fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fence = not fence
        elif not fence:
            yield number, line


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """GitHub's slugs of a page's headings: lower case, punctuation other than - and _ dropped,
    spaces to hyphens, a repeat numbered."""
    seen: dict[str, int] = {}
    for _, line in _outside_fences(path.read_text(encoding="utf-8")):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
            slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return frozenset(seen)


def link_problems(path: Path) -> list[str]:
    problems = []
    for number, line in _outside_fences(path.read_text(encoding="utf-8")):
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            where = f"{_rel(path)}:{number}: {target}"
            if not resolved.exists():
                problems.append(f"{where}: no file {file}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where}: {_rel(resolved)} has no heading #{anchor}")
    return problems


# ---- small inputs the documented commands read ----------------------------------------------


def _train_tiny(save: Path, *extra: str) -> None:
    from megatron_het.errors import run_cli
    from megatron_het.training.entry import main

    argv = ["--model", "tiny", "--seq-length", "64", "--micro-batch-size", "2"]
    argv += ["--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "0"]
    run_cli(lambda: main([*argv, "--save", str(save), "--save-interval", "2", *extra], {}))


def _make_tiny_run(root: Path) -> None:
    mock_data = ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256")
    _train_tiny(root / "runs/tiny", *mock_data)


def _make_profiled_run(root: Path) -> None:
    """The trace of the profiling example in docs/training.md."""
    from megatron_het.errors import run_cli
    from megatron_het.training.entry import main

    argv = ["--model", "tiny", "--mock-data", "--tokenizer-type", "NullTokenizer"]
    argv += ["--vocab-size", "300", "--seq-length", "16", "--micro-batch-size", "2"]
    argv += ["--global-batch-size", "4", "--train-iters", "4", "--eval-iters", "0", "--profile"]
    argv += ["--profile-step-start", "2", "--profile-step-end", "4"]
    run_cli(lambda: main([*argv, "--tensorboard-dir", str(root / "runs/profile")], {}))


def _make_demo_output(root: Path) -> None:
    """A miniature of what ``make demo`` writes: corpus, tokenizer, data, a checkpoint."""
    import sentencepiece

    out = root / "demo_output"
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"Scene {i}: the {w} of the {v} is {w}ing, said the {v}." for i in range(200)
             for w, v in (("king", "land"), ("queen", "sea"), ("fool", "court"))]  # fmt: skip
    (out / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with (out / "corpus.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in lines)
    sentencepiece.SentencePieceTrainer.train(
        input=str(out / "corpus.txt"), model_prefix=str(out / "tokenizer"), vocab_size=100,
        model_type="bpe", minloglevel=2,
    )  # fmt: skip
    tokenizer = ("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model")
    _run_path(REPO / "tools/preprocess_data.py", ["--input", str(out / "corpus.jsonl"),
              "--output-prefix", str(out / "corpus"), *tokenizer, str(out / "tokenizer.model"),
              "--append-eod", "--workers", "1", "--no-progress"])  # fmt: skip
    data = ("--data-path", str(out / "corpus_text_document"), "--split", "90,10,0")
    _train_tiny(out / "checkpoints", *data, *tokenizer, str(out / "tokenizer.model"))


# name -> what makes it (under a root directory); a command that names one gets a copy
INPUTS: dict[str, Callable[[Path], None]] = {
    "runs/tiny": _make_tiny_run,
    "runs/profile": _make_profiled_run,
    "demo_output": _make_demo_output,
}


@dataclass
class Inputs:
    root: Path
    made: set[str] = field(default_factory=set)

    def copy(self, name: str, scratch: Path) -> None:
        if name not in self.made:
            with contextlib.redirect_stdout(io.StringIO()):
                INPUTS[name](self.root)
            self.made.add(name)
        shutil.copytree(self.root / name, scratch / name, symlinks=True)


def inputs_read(tokens: list[str]) -> list[str]:
    """The inputs a command reads: named by a token, not as the directory it saves to."""
    named = [
        name for i, token in enumerate(tokens) for name in INPUTS
        if (token == name or token.startswith(name + "/"))
        and tokens[i - 1] not in ("--save", "--save-dir", "--output-prefix", "--tensorboard-dir")
    ]  # fmt: skip
    return sorted(set(named))


@pytest.fixture(scope="session")
def small_inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return Inputs(tmp_path_factory.mktemp("doc_inputs"))


# ---- running a command ------------------------------------------------------------------------


def run(call: Call, scratch: Path) -> int:
    """Run ``call`` in ``scratch``, in-process, or in a subprocess where it is a shell script or
    the launcher (which replaces its process with the command it launches); its exit status."""
    if call.path.endswith(".sh") or call.program == "launch":
        # (scripts find the repository, and its .venv, from their own path)
        argv = ["bash", str(REPO / call.path)] if call.path.endswith(".sh") else [
            sys.executable, "-m", "megatron_het.launcher"]  # fmt: skip
        env = {**os.environ, "PYTHON": sys.executable, **call.env}
        return subprocess.run([*argv, *call.args], env=env, timeout=120).returncode
    if call.program == "pretrain":
        from megatron_het.errors import run_cli
        from megatron_het.training.entry import main

        entry = functools.partial(run_cli, lambda: main(call.args, dict(os.environ)))
    elif call.program.startswith("tools/"):
        entry = functools.partial(_run_path, scratch / call.program, call.args)
    else:
        module = {"demo": "megatron_het.demo", "gpu_check": "tools.gpu_check"}
        entry = functools.partial(_run_module, module.get(call.program, call.program), call.args)
    import torch

    threads, handler = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    try:
        entry()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:  # tools set torch's threads and the trainer a SIGTERM handler: not for later tests
        torch.set_num_threads(threads)
        signal.signal(signal.SIGTERM, handler)
    return 0


def _case(command: Command) -> object:
    return pytest.param(command, id=command.where, marks=[pytest.mark.slow] * is_slow(command))


RUN_COMMANDS = [c for c in all_commands() if classify(c)[0] == "RUN"]


# ---- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_links_resolve(doc: Path) -> None:
    problems = link_problems(doc)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_flags_exist(doc: Path) -> None:
    problems = flag_problems(doc)
    assert not problems, "flags that no program has:\n" + "\n".join(problems)


def test_every_command_is_classified() -> None:
    unclassified = [
        f"{c.where}: {c.text}\n  {why}"
        for c in all_commands()
        for kind, why in [classify(c)]
        if kind == "UNCLASSIFIED"
    ]
    assert not unclassified, "commands no rule classifies:\n" + "\n".join(unclassified)


@pytest.mark.parametrize("command", [_case(c) for c in RUN_COMMANDS])
def test_documented_command_runs(
    command: Command,
    tmp_path: Path,
    small_inputs: Inputs,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
) -> None:
    tokens = shlex.split(command.text, comments=True)
    for entry in REPO_ENTRIES:
        (tmp_path / entry).symlink_to(REPO / entry)
    for name in inputs_read(tokens):
        small_inputs.copy(name, tmp_path)
    monkeypatch.chdir(tmp_path)
    call = resolve(tokens)
    for name, value in call.env.items():
        monkeypatch.setenv(name, value)
    status = run(call, tmp_path)
    out, err = capfd.readouterr()
    tail = "\n".join((out + err).splitlines()[-15:])
    assert status == 0, f"{command.where}: `{command.text}` exited with {status}:\n{tail}"


def test_the_checks_catch_a_broken_link_and_an_invented_flag(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [a](missing.md), [b](#page) and [c](#nowhere).\n\n"
        "Train with `--bf16` and `--turbo-mode`.\n\n```bash\n"
        "python pretrain_llama.py --model tiny --warp 9 \\\n    --dry-run\n```\n",
        encoding="utf-8",
    )
    assert link_problems(page) == [
        "page.md:3: missing.md: no file missing.md",
        "page.md:3: #nowhere: page.md has no heading #nowhere",
    ]
    assert flag_problems(page) == [
        "page.md:8: --warp is not a flag of pretrain",
        "page.md:5: --turbo-mode is no program's flag",
    ]
    (command,) = scan(page)[0]
    assert command.line == 8 and classify(command) == ("RUN", "--dry-run")
