"""Every command the README and the docs pages show runs as shown (tests/doc_commands.py reads them off the
pages, so a page that changes is tested as it now reads).

Two forms of each command. CI's (engine tier): the command with `--dry-run` where it has one (bench.run,
bench.perf, bench.plan.calibrate, scripts/glm_sweep.sh: every key, value and cell checked, nothing launched),
as shown where it takes seconds (bench.plan, bench.report on hand-made records, mkdocs), `--collect-only` for
a test tier. The slow tier's (scripts/test_slow.sh): the real run at its smallest honest size (steps cut to
14, a checkpoint every 5 steps; every output under a temporary results folder), except what takes hours on
this CPU or needs hardware it lacks, which keeps its dry run and says why. A command no rule knows fails the
test: a new kind of command gets a runner before its page lands.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import report_records
from doc_commands import REPO, Shown, extract, pages, shown_commands, usage_options

from bench.run.cli_checks import config_groups
from bench.run.config import compose
from bench.run.dry_run import check_cell, expand
from tests.processes import run_tree

PYTHON = sys.executable
BIN = Path(PYTHON).parent
# Where a page puts a value the reader chooses, or a folder an earlier command of the page wrote.
RECORD_FOLDERS = re.compile(r"^(DIR|results/(sweeps|perf)/\S+)$")
# The slow tier's smallest honest size: 14 steps is the least a soak fits (10 after warm-up and the first tenth)
SLOW_CAPS = {"steps": 14, "warmup_steps": 2, "checkpoint.every": 5}
SLOW_MAX_CELLS = 8  # a documented sweep larger than this keeps its dry run in the slow tier too
CPU_MODELS = ("tiny",)  # bench.perf runs for real only on these (glm-base: 15 runs of 1-15 minutes)


@dataclass
class Form:
    """How a tier runs one documented command: argv (None: not run, `why` says so), the exit statuses that
    mean it worked, and why it is run this way when not as shown."""
    argv: list[str] | None
    why: str = ""
    ok_exits: tuple[int, ...] = (0,)
    env: dict[str, str] = field(default_factory=dict)
    serve: bool = False  # a server: started, asked for its first page, stopped


def _settings(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading NAME=value settings of a shell command, and the rest."""
    env = {}
    while words and re.match(r"^[A-Z][A-Z0-9_]*=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def _fill(words: list[str], records: str, scratch: str) -> list[str]:
    """Placeholders out: `...` dropped, `[--opt x]` opened (a balanced `k=[a,b]` kept), a record folder
    replaced by the one an earlier command wrote under `scratch` (the slow tier runs a page's sweep before its
    report), else by `records`."""
    out = []
    for word in words:
        if word == "...":
            continue
        if word.startswith("[") or word.count("[") != word.count("]"):  # `[k=v]`, `[--opt x]`; not `k=[a,b]`
            word = word.strip("[]")
        if RECORD_FOLDERS.match(word) or "<" in word:
            written = sorted(Path(scratch).glob(word.replace("<name>", "*")))
            word = str(written[-1]) if written and word.startswith("results/") else records
        out.append(word)
    return out


def _cap(words: list[str]) -> list[str]:
    """The slow tier's size: each SLOW_CAPS key cut to its cap (the page's value when smaller)."""
    out = []
    for word in words:
        key, sep, value = word.partition("=")
        if sep and key in SLOW_CAPS and value.isdigit() and int(value) > SLOW_CAPS[key]:
            word = f"{key}={SLOW_CAPS[key]}"
        out.append(word)
    return out


def form(shown: Shown, tier: str, records: str, scratch: str) -> Form:
    """How `tier` ("ci" or "slow") runs a documented command."""
    env, words = _settings(shown.words)
    words = _fill(words, records, scratch)
    head, args = words[0], words[1:]
    if head == "bash":
        return _script_form(args, env, tier)
    if "--dry-run" in args:  # the page shows the dry run itself
        return Form([PYTHON, *args])
    if head == "mkdocs":
        if args[:1] == ["serve"]:
            return Form(["mkdocs", *args], "served on a free port, its first page fetched, then stopped", serve=True)
        return Form(["mkdocs", *args, "--site-dir", os.path.join(scratch, "site")], "the site built into a "
                    "temporary folder")
    if head != "python":
        raise AssertionError(f"{shown.where}: no runner for {shown.text!r}")
    if args[0] != "-m":
        if args[0] in ("scripts/gpu_check.py", "scripts/gpu_plans.py"):
            if _cuda():
                return Form([PYTHON, *args], "needs CUDA")
            return Form([PYTHON, args[0], "--dry-run"], "its dry run: the commands printed (the runs need a CUDA "
                        "device)")
        raise AssertionError(f"{shown.where}: no runner for the script in {shown.text!r}")
    module, rest = args[1], args[2:]
    if module == "pytest":  # a test tier: collecting it checks its marker expression and every test module
        return Form([PYTHON, "-m", "pytest", *rest, "--collect-only", "-q"], "a test tier: collected, not run "
                    "(this test runs inside one)")
    if module == "bench.run":
        return _run_form(rest, tier, scratch)
    if module == "bench.perf":
        real = tier == "slow" and any(f"model={m}" in rest for m in CPU_MODELS)
        if "--dry-run" in rest or not real:
            why = "" if "--dry-run" in rest else ("its dry run: every run's command line checked" if tier == "ci"
                                                  else "glm-base runs: 15 of 1-15 minutes each on this CPU")
            return Form([PYTHON, "-m", "bench.perf", *_with(rest, "--dry-run")], why)
        return Form([PYTHON, "-m", "bench.perf", *rest, f"output_root={scratch}/results"], "outputs in a "
                    "temporary folder")
    if module == "bench.plan.calibrate":
        return Form([PYTHON, "-m", module, *_with(rest, "--dry-run")], "its dry run: the fit printed, the stored "
                    "calibrations left as they are")
    if module == "bench.plan":  # exit 1 is its verdict "does not fit", stated on the terminal
        return Form([PYTHON, "-m", module, *rest], ok_exits=(0, 1))
    if module == "bench.plan.facts":  # exit 1 would be a verdict disagreeing without its reason: a failure
        return Form([PYTHON, "-m", module, *rest])
    if module == "bench.report":
        return Form([PYTHON, "-m", module, *rest], "on hand-made records" if records in rest else "")
    raise AssertionError(f"{shown.where}: no runner for the module {module}")


def _with(words: list[str], flag: str) -> list[str]:
    """The arguments with `flag` first, unless the page shows it already."""
    return words if flag in words else [flag, *words]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _script_form(args: list[str], env: dict[str, str], tier: str) -> Form:
    script = args[0]
    if script == "scripts/setup.sh":
        if tier == "ci":  # CI's scripts/test.sh ran it before this test: checked there, not again here
            test_sh = (REPO / "scripts" / "test.sh").read_text()
            assert "bash scripts/setup.sh" in test_sh, "scripts/test.sh no longer runs the set-up"
            return Form(None, "run by scripts/test.sh before the tests")
        return Form(["bash", *args], "run again: it keeps what is installed")
    if script in ("scripts/test.sh", "scripts/test_slow.sh"):
        return Form(["bash", "-n", script], "a test tier: its syntax checked (this test runs inside a tier)")
    if script == "scripts/glm_sweep.sh":
        if "COMMIT" in env and subprocess.run(["git", "cat-file", "-e", f"{env['COMMIT']}^{{commit}}"], cwd=REPO,
                                              capture_output=True).returncode:
            return Form(None, f"COMMIT={env['COMMIT']} is not in this clone's history (a shallow clone)")
        if "COMMIT" in env and tier == "ci":  # the same dry run runs for the page's plain command
            return Form(["git", "rev-parse", "--verify", f"{env['COMMIT']}^{{commit}}"], "the commit it names "
                        "resolves; the sweep's dry run is the plain command's (the slow tier runs this one's too)")
        return Form(["bash", script, *_with(args[1:], "--dry-run")], "its dry run: the sweep takes hours", env=env)
    if script == "scripts/slurm_local.sh":
        return Form(["bash", "-n", script], "SLURM's daemons as root: tests/test_multinode.py starts and stops them")
    if script == "scripts/cpu_rung.sh":
        return Form(["bash", script, *_with(args[1:], "--dry-run")], "its dry run: the rung takes hours")
    raise AssertionError(f"no runner for the script {script}")


def _run_form(rest: list[str], tier: str, scratch: str) -> Form:
    if "--help" in rest:
        return Form([PYTHON, "-m", "bench.run", *rest])
    dry = Form([PYTHON, "-m", "bench.run", "--dry-run", *rest], "its dry run: every cell checked, nothing launched")
    if tier == "ci":
        return dry
    if any(word.startswith("hydra/launcher=submitit_slurm") for word in rest):
        return Form(None, "needs a SLURM cluster")
    if any(re.fullmatch(r"launcher\.nnodes=([2-9]|\d\d+)", word) for word in rest):
        return Form(None, "one node of several: the others run beside it (tests/test_multinode.py)")
    sweeping = "-m" in rest
    cells = len(expand([w for w in rest if not w.startswith("-")])) if sweeping else 1
    if cells > SLOW_MAX_CELLS:
        dry.why = f"{cells} cells: hours on this CPU; its dry run"
        return dry
    return Form([PYTHON, "-m", "bench.run", *_cap(rest), f"output_root={scratch}/results"],
                "outputs in a temporary folder" + (", steps capped" if _cap(rest) != rest else ""))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def execute(f: Form, timeout: float) -> tuple[int, str]:
    """Run a form from the repository root; (exit status, output)."""
    assert f.argv is not None
    argv = [str(BIN / f.argv[0]) if f.argv[0] == "mkdocs" else f.argv[0], *f.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_MKDOCS_2_WARNING": "1", **f.env}
    if f.serve:
        port = _free_port()
        server = subprocess.Popen([*argv, "-a", f"127.0.0.1:{port}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and server.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                        return (0 if page.status == 200 and b"rlhf-bench" in page.read() else 1), ""
                except OSError:
                    time.sleep(1)
            return 1, f"no page served within {timeout} s (exit {server.poll()})"
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            output = server.communicate(timeout=30)[0]
            if server.returncode not in (0, -signal.SIGTERM):
                print(output)
    done = run_tree(argv, timeout, check=False, cwd=REPO, env=env, text=True)
    return done.returncode, done.stdout + done.stderr


def _check(shown: Shown, f: Form, timeout: float) -> None:
    if f.argv is None:
        pytest.skip(f"{shown.where}: {f.why}")
    code, output = execute(f, timeout)
    assert code in f.ok_exits and "Traceback (most recent call last)" not in output, (
        f"{shown.where}: `{shown.text}` run as `{' '.join(f.argv)}` ({f.why or 'as shown'}) exited {code}:\n"
        f"{output[-4000:]}")


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> str:
    """Hand-made records (tests/report_records.py) for the report commands: two frameworks' PPO cells."""
    root = str(tmp_path_factory.mktemp("records"))
    for framework in ("dschat", "colossalai"):
        cfg = report_records.config(**{"framework.name": framework})
        report_records.write(root, framework, report_records.record(cfg, run_id=framework))
    return root


COMMANDS = shown_commands()
RUNNABLE = [c for c in COMMANDS if not c.is_usage]
USAGES = [c for c in COMMANDS if c.is_usage]


def _id(shown: Shown) -> str:
    return f"{shown.where} {shown.text[:70]}"


def test_the_reader_finds_commands_in_blocks_continued_lines_and_prose_but_not_in_output_or_names():
    page = "\n".join([
        "Set up:", "", "    bash scripts/setup.sh && .venv/bin/python -m bench.run zero=2   # first run", "",
        "Output:", "", "    prerequisite SFT model: trained once",
        "    report: python -m bench.report results/runs", "",
        "    python -m bench.run -m a=1,2 \\", "        b=3", "",
        "Then `python3 -m bench.report results/sweeps/x`, the module `bench.plan`, the file `scripts/gpu_check.py`,",
        "and `COMMIT=abc bash scripts/glm_sweep.sh`.", "",
        "    python -m bench.run [zero=0|1] [lora=RANK]", "                        [tp=N]"])
    found = [(s.line, s.text, s.is_usage) for s in extract(page, "page.md")]
    assert found == [
        (3, "bash scripts/setup.sh", False), (3, "python -m bench.run zero=2", False),
        (10, "python -m bench.run -m a=1,2 b=3", False),
        (13, "python -m bench.report results/sweeps/x", False),
        (14, "COMMIT=abc bash scripts/glm_sweep.sh", False),
        (16, "python -m bench.run [zero=0|1] [lora=RANK] [tp=N]", True)]


def test_every_page_is_read_and_every_command_has_a_runner_in_both_tiers(tmp_path):
    assert len(pages()) >= 10 and len(COMMANDS) >= 30, (len(pages()), len(COMMANDS))
    for shown in RUNNABLE:  # form() fails on a command no rule knows
        for tier in ("ci", "slow"):
            form(shown, tier, "DIR", str(tmp_path))


def test_every_script_a_page_names_exists():
    """A script the README or a page names (run or described) is in scripts/; the framework pages are left out:
    their `scripts/...` paths are upstream's (DeepSpeed-Chat's training/step3_rlhf_finetuning/..., coati's)."""
    ours = [p for p in pages() if "frameworks" not in p.parts]
    named = {m for p in ours for m in re.findall(r"\bscripts/[\w*.-]*\w", p.read_text())}
    assert len(named) >= 10, named
    missing = sorted(name for name in named if not list(REPO.glob(name)))
    assert not missing, f"pages name scripts that are not in the repository: {missing}"


def _same_run(f: Form) -> tuple:
    """What makes two forms one run: a form that is not run is its own (its reason is printed per page)."""
    if f.argv is None:
        return (id(f),)
    return tuple(f.argv), tuple(sorted(f.env.items())), f.serve, f.ok_exits


@pytest.mark.engine
def test_every_documented_command_runs_as_shown(records, tmp_path, capsys):
    """CI's form of every command, two at a time (one core each); the list, with exits and times, printed."""
    forms = []
    for i, shown in enumerate(RUNNABLE):  # each command its own folders: two run at once
        own = tmp_path / str(i)
        shutil.copytree(records, own / "records")
        forms.append((shown, form(shown, "ci", str(own / "records"), str(own))))

    def run(f: Form) -> tuple[int | None, str, float]:
        start = time.monotonic()
        if f.argv is None:
            return None, "", 0.0
        code, output = execute(f, timeout=600)
        return code, output, time.monotonic() - start

    # a command two pages show alike (the same argv and settings, no folder of its own) runs once for both
    distinct: dict[tuple, Form] = {}
    for _, f in forms:
        distinct.setdefault(_same_run(f), f)
    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = dict(zip(distinct, pool.map(run, distinct.values()), strict=True))
    results = [outcomes[_same_run(f)] for _, f in forms]
    lines, failed = [], []
    for (shown, f), (code, output, seconds) in zip(forms, results, strict=True):
        how = " ".join(f.argv) if f.argv else "not run"
        verdict = f"exit {code}, {seconds:.1f} s" if code is not None else ""
        lines.append(f"  {shown.where}: {shown.text}\n      -> {how}{f' ({f.why})' if f.why else ''}"
                     f"{f'  [{verdict}]' if verdict else ''}")
        if code is not None and (code not in f.ok_exits or "Traceback (most recent call last)" in output):
            failed.append(f"{shown.where}: `{shown.text}` run as `{how}` exited {code}:\n{output[-3000:]}")
    ran = sum(code is not None for code, _, _ in results)
    runs = sum(f.argv is not None for f in distinct.values())
    with capsys.disabled():
        print(f"\ndocumented commands: {len(COMMANDS)} on {len(pages())} pages; {len(USAGES)} usage synopsis(es) "
              f"checked option by option; {ran} run in their CI form (as {runs} distinct runs), "
              f"{len(RUNNABLE) - ran} not run (reason given)\n" + "\n".join(lines))
    assert not failed, "\n\n".join(failed)


@pytest.fixture(scope="module")
def slow_scratch(tmp_path_factory) -> str:
    """One results folder for the slow tier's runs, in page order: a page's report reads its sweep's records."""
    return str(tmp_path_factory.mktemp("slow"))


@pytest.mark.slow
@pytest.mark.parametrize("shown", RUNNABLE, ids=_id)
def test_a_documented_command_runs_for_real_at_its_smallest_size(shown, records, slow_scratch):
    _check(shown, form(shown, "slow", records, slow_scratch), timeout=1800)


@pytest.mark.parametrize("shown", USAGES, ids=_id)
def test_a_usage_synopsis_names_keys_that_exist_and_every_choice_of_a_group(shown, tmp_path):
    groups, defaults = config_groups(), compose([])
    # a preset with a mandatory value of its own is checked with one: model=checkpoint needs a checkpoint
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    companions = {"model=checkpoint": [f"model.path={tmp_path}"]}
    for key, values in usage_options(shown):
        if key in groups:  # a config group's alternatives are all of its presets
            assert sorted(values) == sorted(groups[key]), (
                f"{shown.where}: [{key}=...] lists {values}; conf/{key}/ has {list(groups[key])}")
        default = _lookup(defaults, key)
        for value in values:
            if value.isupper():  # a value the reader picks (lora=RANK): the key must exist; its default is taken
                value = "null" if default is None else str(default).lower() if isinstance(default, bool) \
                    else str(default)
            cell = check_cell([f"{key}={value}", *companions.get(f"{key}={value}", [])])
            assert cell.outcome != "invalid", f"{shown.where}: {key}={value}: {cell.detail}"


def _lookup(config: dict, dotted: str) -> object:
    node = config
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"{dotted} is not a key of the configuration"
        node = node[part]
    return node


@pytest.mark.engine
@pytest.mark.parametrize(("page_text", "changed"), [
    ("python -m bench.perf --rounds 2 stage=sft model=tiny", "--roundz"),
    ("python -m bench.run framework=colossalai stage=sft zero=2 precision=bf16 lora=64 launcher.nproc=2",
     "launcher.nprocs"),
    ("python -m bench.plan --check plan=conf/plan/example-8b.yaml", "--chek"),
    ("bash scripts/glm_sweep.sh", "--dryrun"),
])
def test_a_page_that_uses_a_flag_the_code_does_not_have_fails(page_text, changed, records, tmp_path):
    """A page's flag the code lost (here: the page misspells it) makes the command's CI form fail."""
    flag = re.split(r"[ =]", changed)[0]
    original = {"--roundz": "--rounds", "launcher.nprocs": "launcher.nproc", "--chek": "--check"}.get(flag)
    text = page_text.replace(original, changed) if original else f"{page_text} {changed}"
    shown = Shown(text, "page.md", 1)
    f = form(shown, "ci", records, str(tmp_path))
    code, output = execute(f, timeout=300)
    assert code not in f.ok_exits, output
    assert changed.split("=")[0] in output, output  # the refusal names what it does not know
