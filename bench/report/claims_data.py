"""The published claims the report checks, as data: conf/claims.yaml (each claim's statement, what its article
published, and the article with the setting it states). The claims check (bench.report.claims) reads the
statements from here; docs/published-claims.md shows `markdown()`."""

from __future__ import annotations

import os
from dataclasses import dataclass

import yaml

CLAIMS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf",
                           "claims.yaml")


@dataclass(frozen=True)
class Source:
    key: str
    title: str
    kind: str
    setting: str


@dataclass(frozen=True)
class PublishedClaim:
    id: str
    source: str
    statement: str  # as the report's table shows it
    published: str  # what the article states
    derived: bool  # a check the report adds to a published claim (its figures against arithmetic)


def load(path: str = CLAIMS_FILE) -> tuple[dict[str, Source], list[PublishedClaim]]:
    """The sources and the claims in the file's order; a claim naming an unknown source is refused by name."""
    with open(path) as f:
        data = yaml.safe_load(f)
    sources = {key: Source(key, **fields) for key, fields in data["sources"].items()}
    claims = [PublishedClaim(c["id"], c["source"], c["statement"], c["published"], bool(c.get("derived")))
              for c in data["claims"]]
    unknown = sorted({c.source for c in claims} - set(sources))
    if unknown:
        raise ValueError(f"{path}: claims name unknown sources {unknown}; allowed: {sorted(sources)}")
    return sources, claims


def statements(path: str = CLAIMS_FILE) -> dict[str, str]:
    return {c.id: c.statement for c in load(path)[1]}


def markdown(path: str = CLAIMS_FILE) -> str:
    """The page's tables: each article with its stated setting, then every claim with what was published."""
    sources, claims = load(path)
    lines = ["| article | what it is | setting it states |", "|---|---|---|"]
    lines += [f"| {s.key}: {s.title} | {s.kind} | {s.setting} |" for s in sources.values()]
    lines += ["", "| claim | article | as the report states it | as the article states it |", "|---|---|---|---|"]
    for c in claims:
        shown = f"{c.statement} (a check the report adds)" if c.derived else c.statement
        lines.append(f"| {c.id} | {c.source} | {shown} | {c.published} |")
    return "\n".join(lines) + "\n"
