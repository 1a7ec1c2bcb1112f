"""Where a run came from: the code (commit, dirty tree, diff), the host type, the library versions and the
measurement settings, read from its record; and whether the runs of one cell agree on them.

A cell's runs are repeats only when they differ in the seed alone. Runs of one configuration made at two
commits, from a dirty and a clean tree, on two host types, with two sets of library versions or two
measurement settings are not: their spread holds a code or machine change. The collector marks such a cell
`mixed` (with the reasons), and verdicts and decision-tree leaves refuse it unless the report is asked to
allow it (`--allow-mixed-provenance`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Environment entries that change what is measured without being part of the configuration: the threads each
# rank's torch used (time), and whether a tracker ran beside the run (time and host memory).
MEASUREMENT_ENVIRONMENT = ("omp_num_threads", "torch_threads")
MEASUREMENT_CONFIG = ("wandb",)


@dataclass(frozen=True)
class Provenance:
    commit: str | None      # the full commit id; None for a record made outside a git checkout
    dirty: bool | None      # tracked files differed from the commit; None: not recorded
    diff: str | None        # SHA-256 of `git diff HEAD` where dirty (older records: none kept)
    host_type: str | None   # CPU model x cores, memory (bench.measure.environment.host)
    versions: str           # "name version" of every library recorded, sorted
    settings: str           # the measurement settings outside the configuration

    @property
    def code(self) -> str:
        """The code in a few words: the short commit, "+dirty" (and the diff's hash) where the tree differed."""
        if self.commit is None:
            return "unknown commit"
        short = self.commit[:10]
        if not self.dirty:
            return short
        return f"{short}+dirty" + (f" ({self.diff[:8]})" if self.diff else "")


def of(record: dict[str, Any]) -> Provenance:
    """A record's provenance; records from before environment.git and environment.host kept the commit as
    `git_commit` ("<sha>" or "<sha>-dirty") and the host as cpu, cpu_count and host_memory_bytes."""
    env = record.get("environment") or {}
    git = env.get("git")
    if isinstance(git, dict):
        commit, dirty, diff = git.get("commit"), git.get("dirty"), git.get("diff_sha256")
    else:
        text = env.get("git_commit")
        commit = text.removesuffix("-dirty") if isinstance(text, str) else None
        dirty = text.endswith("-dirty") if isinstance(text, str) else None
        diff = None
    host = env.get("host")
    if isinstance(host, dict) and host.get("type"):
        host_type = host["type"]
    elif env.get("cpu"):
        memory = env.get("host_memory_bytes")
        host_type = f"{env['cpu']} x {env.get('cpu_count')}" + (f", {memory / 2**30:.0f} GiB" if memory else "")
    else:
        host_type = None
    if host_type and not (isinstance(host, dict) and "matrix_isa" in host):
        # two CPUs of one name can differ in their 16-bit matrix instructions (and time alike only with the same
        # ones): a record from before environment.host.matrix_isa cannot say which it had, and its kernel build
        # is what tells such machines apart (this workplace's two kinds of 2-core VM ran different builds)
        kernel = host.get("kernel") if isinstance(host, dict) else None
        host_type += ", matrix ISA not recorded" + (f", kernel {kernel}" if kernel else "")
    gpu = env.get("gpu")
    if isinstance(gpu, dict) and gpu.get("name"):
        host_type = f"{host_type}; {gpu.get('count', 1)} x {gpu['name']}"
    libraries = env.get("libraries") or {}
    versions = ", ".join(f"{k} {v}" for k, v in sorted(libraries.items()) if v)
    config = record.get("config") or {}
    settings = " ".join([f"{k}={env.get(k)}" for k in MEASUREMENT_ENVIRONMENT]
                        + [f"{k}={config.get(k)}" for k in MEASUREMENT_CONFIG])
    return Provenance(commit, dirty, diff, host_type, versions, settings)


def from_row(row: dict[str, Any]) -> Provenance:
    """The provenance the collector copied onto a flat row (bench.results.collect.stage_row)."""
    return Provenance(row.get("git_commit"), row.get("git_dirty"), row.get("git_diff"), row.get("host_type"),
                      row.get("versions") or "", row.get("measurement_env") or "")


def mixture(runs: list[Provenance]) -> list[str]:
    """Why the runs of one cell are not repeats of one thing: each field in which they differ, with the number
    of distinct values; empty when they agree."""
    reasons = []
    commits = {p.commit for p in runs}
    if len(commits) > 1:
        reasons.append(f"{len(commits)} commits")
    if len({p.dirty for p in runs}) > 1:
        reasons.append("dirty and clean trees")
    elif any(p.dirty for p in runs) and len({p.diff for p in runs}) > 1:
        reasons.append(f"{len({p.diff for p in runs})} different uncommitted diffs")
    for name, label in (("host_type", "host types"), ("versions", "library version sets"),
                        ("settings", "measurement settings")):
        values = {getattr(p, name) for p in runs}
        if len(values) > 1:
            reasons.append(f"{len(values)} {label}")
    return reasons


def flag(runs: list[Provenance]) -> str:
    """The table's provenance column for one cell: "mixed: ..." where its runs differ, "dirty tree" where they
    agree but ran uncommitted code, "-" where they are clean repeats at one commit."""
    reasons = mixture(runs)
    if reasons:
        return "mixed: " + ", ".join(reasons)
    if any(p.dirty for p in runs):
        return "dirty tree"
    return "-"
