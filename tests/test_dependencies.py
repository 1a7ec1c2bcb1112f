"""What the code imports against what pyproject.toml declares, and what a run without an optional extra does:
every module under bench/ and adapters/ imports without the extras, and a run that needs one is refused before
launch naming the modules and the command that installs them."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"bench", "adapters"}
# installed by scripts/setup.sh outside pip's resolver (pyproject.toml's colossalai extra says why)
OUTSIDE_RESOLVER = {"colossalai"}
# modules whose distribution a CPU machine does not have installed, so its metadata cannot name it
NOT_INSTALLED_HERE = {"pynvml": "nvidia-ml-py"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return {_normal(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in requirements}


def _imported_top_level(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - FIRST_PARTY - set(sys.stdlib_module_names)


def test_every_distribution_the_code_imports_is_declared():
    code = sorted(p for d in ("bench", "adapters") for p in (REPO / d).rglob("*.py"))
    imported = _imported_top_level(code)
    assert {"torch", "deepspeed", "yaml", "colossalai", "trl"} <= imported  # the walk sees lazy imports too
    owners = importlib.metadata.packages_distributions()
    undeclared = {}
    for module in sorted(imported):
        distributions = {_normal(d) for d in owners.get(module, [])} or {NOT_INSTALLED_HERE.get(module, "")} - {""}
        assert distributions, f"{module} is imported but no installed distribution provides it"
        if not distributions & (_declared() | OUTSIDE_RESOLVER):
            undeclared[module] = sorted(distributions)
    assert not undeclared, f"imported but not in pyproject.toml: {undeclared}"


PROBE = r"""
import importlib, json, pkgutil, runpy, sys
import bench, adapters
failed = {}
for package in (bench, adapters):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            importlib.import_module(info.name)
        except Exception as err:
            failed[info.name] = repr(err)
from bench.run.config import compose
from bench.run.spec import spec_from_config
refusals = {}
for overrides in (["framework=colossalai"], ["framework=dschat", "stage=ppo", "reference.quant=int8",
                                             "quant_library=bitsandbytes"]):
    try:
        spec_from_config(compose(overrides))
        refusals[" ".join(overrides)] = None
    except Exception as err:
        refusals[" ".join(overrides)] = [type(err).__name__, str(err)]
sys.argv = ["bench.run", "framework=colossalai", "output_root=" + sys.argv[1]]
try:
    runpy.run_module("bench.run", run_name="__main__")
    code = 0
except SystemExit as exit:
    code = exit.code
print("PROBE" + json.dumps({"failed": failed, "refusals": refusals, "exit": code}))
"""


@pytest.mark.engine
@pytest.mark.slow  # 97 s of CI's 30 minutes (a venv built and pip-installed): scripts/test_slow.sh
def test_a_fresh_venv_with_the_plain_install_imports_every_module_and_names_the_missing_extras(tmp_path):
    """`pip install -e .` alone (no extras, so no colossalai, einops, galore-torch nor bitsandbytes) in a new venv,
    torch installed first as scripts/setup.sh does: every module under bench/ and adapters/ imports, and the runs
    that need an extra are refused before launch with the modules and the command that installs them."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch_spec = f"torch=={importlib.metadata.version('torch').split('+')[0]}"
    subprocess.run([*pip, torch_spec], check=True, timeout=900, capture_output=True)
    subprocess.run([*pip, "-e", str(REPO)], check=True, timeout=900, cwd=tmp_path, capture_output=True)
    absent = json.loads(subprocess.run(
        [python, "-c", "import importlib.util as u, json; print(json.dumps([m for m in ('colossalai', 'einops', "
         "'galore_torch', 'bitsandbytes') if u.find_spec(m) is None]))"],
        capture_output=True, text=True, check=True).stdout)
    # einops comes with deepspeed (one of its requirements); the rest of the extra is missing
    assert absent == ["colossalai", "galore_torch", "bitsandbytes"]
    out = tmp_path / "out"
    proc = subprocess.run([python, "-c", PROBE, str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ""})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PROBE")]
    assert len(lines) == 1, proc.stderr[-3000:]
    probe = json.loads(lines[0][len("PROBE"):])
    assert probe["failed"] == {}
    kind, message = probe["refusals"]["framework=colossalai"]
    assert kind == "MissingExtraError"
    assert message.startswith("framework=colossalai needs colossalai, galore_torch, bitsandbytes, not installed")
    assert "pip install -e '.[colossalai]'" in message and "--no-deps colossalai==0.5.0" in message
    kind, message = probe["refusals"]["framework=dschat stage=ppo reference.quant=int8 quant_library=bitsandbytes"]
    assert (kind, message) == ("MissingExtraError", "quant_library=bitsandbytes (reference quantized) needs "
                               "bitsandbytes, not installed: pip install -e '.[bitsandbytes]' (scripts/setup.sh "
                               "installs it)")
    assert probe["exit"] == 2  # refused before launch
    assert "framework=colossalai needs colossalai" in proc.stdout  # what bench.run printed as it refused
    assert not out.exists()  # nothing written
