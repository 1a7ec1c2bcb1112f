"""Writes the report: Markdown, one self-contained HTML page (figures inlined), CSV and Parquet."""

from __future__ import annotations

import base64
import html
import os
import re
from dataclasses import dataclass
from typing import Any

from bench.report.claims import UNITS, VERDICT_RULE, Verdict
from bench.report.decision import Leaf, Node, questions
from bench.report.plots import Figure
from bench.report.tables import Table
from bench.results.collect import Collection


@dataclass
class Report:
    collection: Collection
    tables: list[Table]
    plots: list[Figure]
    tree: Node
    claims: list[Verdict]
    caveat: str
    generated_utc: str
    environment: list[Table]  # shown first, before any figure


def _summary(report: Report) -> list[str]:
    c = report.collection
    statuses: dict[str, int] = {}
    for record in c.records.values():
        statuses[record["status"]] = statuses.get(record["status"], 0) + 1
    refused = c.refused()
    lines = [f"Source: `{c.root}`; generated {report.generated_utc}; every row as CSV: [table.csv](table.csv) "
             "(Parquet: table.parquet).",
             f"{len(c.records)} runs ({', '.join(f'{s} {n}' for s, n in sorted(statuses.items()))}), "
             f"{len(c.rows)} stage rows in {len(c.cells)} cells; {len(c.problems)} record files skipped as "
             f"unreadable; {len(c.duplicates)} copies of a run already collected counted once."]
    if refused:
        lines.append(f"{len(refused)} cell(s) mix provenance (runs at different commits, dirty states, hosts, "
                     "versions or measurement settings): shown in the tables with their flag, refused by every "
                     "verdict and decision-tree leaf (--allow-mixed-provenance counts them).")
    elif c.allow_mixed and any(r.get("mixed") for r in c.rows):
        lines.append("Cells that mix provenance are counted as evidence (--allow-mixed-provenance): their spread "
                     "may hold code or machine changes.")
    return lines


def _compared(report: Report) -> str:
    """What was compared and on what, in a line: frameworks, models, stages, hosts, runs, commits."""
    rows = report.collection.rows
    frameworks = sorted({r["framework"] for r in rows})
    models = sorted({r["model"] for r in rows})
    stages = sorted({r["stage"] for r in rows})
    hosts = sorted({r.get("host_type") or "unknown host" for r in rows})
    commits = sorted({(r.get("git_commit") or "unknown")[:12] for r in rows})
    return (f"Compared: {', '.join(frameworks)} on {', '.join(models)} ({', '.join(stages)}); "
            f"{len(report.collection.records)} runs on {'; '.join(hosts)}; commit(s) {', '.join(commits)}.")


def _answers(report: Report) -> list[str]:
    """The decision tree's measured leaves as sentences, each with what it rests on; then how many combinations
    no run measured (the full tree lists them)."""
    out, unmeasured = [], 0
    for answers, found in questions(report.tree):
        model, ranks, precision, tuning = answers
        scope = next((e for e in found.evidence if e.startswith("rests on")), None)
        if scope is None:
            unmeasured += 1
            continue
        out.append(f"With {model} on {ranks} {report.tree.ranks}, {precision}, {tuning}: {found.verdict} ({scope}).")
    if unmeasured:
        out.append(f"{unmeasured} more combination(s) of model, {report.tree.ranks}, precision and fine-tuning have no "
                   "measured run (the decision tree below lists them).")
    return out


def _claim_counts(report: Report) -> str:
    counts: dict[str, int] = {}
    for v in report.claims:
        counts[v.verdict] = counts.get(v.verdict, 0) + 1
    return "Published claims: " + "; ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items(),
                                                                                        key=lambda i: -i[1])) + "."


KEY_FIGURES = ("memory_breakdown_ppo", "memory_by_zero")  # the figures the answer section shows (not again)


def _key_figures(report: Report) -> list[tuple[int, Figure]]:
    return [(n, f) for n, f in enumerate(report.plots, 1) if os.path.basename(f.path).startswith(KEY_FIGURES)]


# the figures drawn from a table, placed after it (by their file names); the rest close the tables
BESIDE = {"memory": ("memory_breakdown", "memory_by", "memory_vs_ranks", "ppo_memory_timeline"),
          "throughput": ("throughput_vs",), "stability": ("loss_curves", "reward_curves")}


def _figures_after(report: Report, key: str | None) -> list[tuple[int, Figure]]:
    """The numbered figures placed after table `key` (None: those no table draws them from), less those the
    answer shows."""
    shown = {n for n, _ in _key_figures(report)}
    placed = tuple(p for prefixes in BESIDE.values() for p in prefixes)
    out = []
    for n, figure in enumerate(report.plots, 1):
        name = os.path.basename(figure.path)
        mine = name.startswith(BESIDE[key]) if key in BESIDE else (key is None and not name.startswith(placed))
        if mine and n not in shown:
            out.append((n, figure))
    return out


def _slug(title: str) -> str:
    """A Markdown heading's anchor as renderers make it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _md_links(text: str) -> str:
    return " ".join(f"[{n}]({path})" for n, path in enumerate(str(text).split(), 1))


def _md_table(table: Table) -> list[str]:
    lines = [f"### {table.title}", "", table.caption, ""]
    if not table.rows:
        return lines + ["(no rows)", ""]
    lines.append("| " + " | ".join(_md_cell(h) for h in table.header) + " |")
    lines.append("|" + "---|" * len(table.header))
    lines += ["| " + " | ".join(_md_links(c) if h in table.links else _md_cell(c)
                                for h, c in zip(table.header, row, strict=True)) + " |" for row in table.rows]
    return lines + [""]


def _md_tree(node: Node, depth: int = 0) -> list[str]:
    lines = [f"{'  ' * depth}- **{node.question}**"]
    for answer, child in node.branches:
        if isinstance(child, Leaf):
            lines.append(f"{'  ' * (depth + 1)}- {answer} -> **{child.verdict}**")
            lines += [f"{'  ' * (depth + 2)}- {e}" for e in child.evidence]
        else:
            lines.append(f"{'  ' * (depth + 1)}- {answer}")
            lines += _md_tree(child, depth + 2)
    return lines


def _plain_questions(node: Node) -> list[str]:
    out = []
    for answers, found in questions(node):
        model, ranks, precision, tuning = answers
        out.append(f"- With model {model} on {ranks} {node.ranks}, {precision} and {tuning}, which framework? "
                   f"{found.verdict}.")
    return out


def _md_figure(n: int, figure: Figure) -> list[str]:
    name = os.path.basename(figure.path)
    return [f"![{name}](plots/{name})", "", f"*Figure {n}.* {figure.caption}", ""]


def markdown(report: Report) -> str:
    lines = ["# rlhf-bench report", "", _compared(report), "", "## The answer", ""]
    lines += [f"- {a}" for a in _answers(report)] + ["", _claim_counts(report) + " (the claims check, below)", ""]
    lines += [line for n, f in _key_figures(report) for line in _md_figure(n, f)]
    lines += ["## Contents", "", "- [Environment](#environment)"]
    lines += [f"- [{t.title}](#{_slug(t.title)})" for t in report.tables]
    lines += ["- [Figures](#figures)", "- [Decision tree](#decision-tree)", "- [Claims check](#claims-check)", ""]
    lines += _summary(report) + ["", "## Environment", ""]
    for table in report.environment:
        lines += _md_table(table)
    if report.collection.problems:
        lines += ["## Skipped record files", ""]
        lines += [f"- `{p.path}`: {p.reason}" for p in report.collection.problems] + [""]
    lines += ["## Tables", "", "Each table's figures follow it; those of the answer are not repeated.", ""]
    for table in report.tables:
        lines += _md_table(table)
        lines += [line for n, f in _figures_after(report, table.key) for line in _md_figure(n, f)]
    rest = _figures_after(report, None)
    lines += ["## Figures", ""] + ([line for n, f in rest for line in _md_figure(n, f)] if rest
                                   else ["Every figure is shown beside its table, or under the answer.", ""])
    lines += ["## Decision tree", "", "Built from the measured rows; a leaf that the data cannot decide says so.", ""]
    lines += _md_tree(report.tree) + ["", "As plain questions:", ""] + _plain_questions(report.tree) + [""]
    lines += ["## Claims check", "", UNITS, "", VERDICT_RULE, "",
              "| claim | statement | verdict | evidence |", "|---|---|---|---|"]
    lines += [f"| {v.claim_id} | {_md_cell(v.claim)} | {v.verdict} | {_md_cell(v.evidence)} |" for v in report.claims]
    lines += ["", f"**Caveat.** {report.caveat}"]
    return "\n".join(lines) + "\n"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1400px;color:#1d1d1f;
padding:0 1rem}
h1{font-size:1.6rem}h2{border-bottom:1px solid #ddd;padding-bottom:.2rem;margin-top:2.2rem}
table{border-collapse:collapse;font-size:.8rem;margin:.5rem 0 1.5rem}
th,td{border:1px solid #ddd;padding:.25rem .5rem;text-align:right;vertical-align:top}
th{background:#f3f3f5;position:sticky;top:0}td.text,th.text{text-align:left}
tr:nth-child(even){background:#fafafa}.caption{color:#555;font-size:.85rem;max-width:1100px}
.status-ok{color:#137333}.status-oom,.status-nan,.status-error,.status-timeout{color:#b3261e;font-weight:600}
.status-unsupported,.status-skipped{color:#8a6d00}img{max-width:100%;border:1px solid #eee;margin:.5rem 0}
ul.tree,ul.tree ul{list-style:none;padding-left:1.2rem;border-left:1px dashed #bbb}
.leaf{font-weight:600}.undecided{color:#8a6d00}.evidence{color:#555;font-size:.85rem;font-weight:400}
.verdict-supported{color:#137333}.verdict-contradicted{color:#b3261e}
"""
TEXT_COLUMNS = {"run", "stage", "status", "stability", "error", "framework", "precision", "plugin", "reference",
                "classification", "statement", "verdict", "evidence", "claim", "engine", "notes",
                "tags", "configuration", "pair", "largest difference", "term", "finetune", "model", "cell",
                "what", "value", "code", "host", "provenance", "records", "command", "seeds"}


# listings a reader opens on purpose: folded in the HTML page (a <details>) past FOLD_ROWS rows
FOLDED = ("runs", "cells", "prediction")
FOLD_ROWS = 20


def _value_class(column: str, cell: str) -> str:
    """Colour by outcome: status-ok / status-oom ..., verdict-supported / verdict-contradicted."""
    if column in ("status", "verdict") and cell:
        return f" {column}-{cell.split(',')[0].split()[0]}"
    return ""


def _html_links(text: str) -> str:
    return " ".join(f"<a href='{html.escape(path)}'>{n}</a>" for n, path in enumerate(str(text).split(), 1))


def _html_table(table: Table) -> str:
    head = "".join(f"<th class='{'text' if h in TEXT_COLUMNS else ''}'>{html.escape(h)}</th>" for h in table.header)
    body = []
    for row in table.rows:
        cells = []
        for column, cell in zip(table.header, row, strict=True):
            css = ("text" if column in TEXT_COLUMNS else "") + _value_class(column, str(cell))
            text = _html_links(cell) if column in table.links else html.escape(str(cell))
            cells.append(f"<td class='{css}'>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    grid = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    if table.key in FOLDED and len(table.rows) > FOLD_ROWS:
        grid = f"<details><summary>{len(table.rows)} rows (open)</summary>{grid}</details>"
    return (f"<h3 id='{table.key}'>{html.escape(table.title)}</h3><p class='caption'>{html.escape(table.caption)}</p>"
            + grid)


def _html_tree(node: Node) -> str:
    items = []
    for answer, child in node.branches:
        if isinstance(child, Leaf):
            evidence = "".join(f"<li class='evidence'>{html.escape(e)}</li>" for e in child.evidence)
            css = "leaf" if child.decided else "leaf undecided"
            items.append(f"<li>{html.escape(answer)} &rarr; <span class='{css}'>{html.escape(child.verdict)}</span>"
                         f"<ul>{evidence}</ul></li>")
        else:
            items.append(f"<li><details open><summary>{html.escape(answer)}</summary>{_html_tree(child)}"
                         "</details></li>")
    return f"<ul class='tree'><li><b>{html.escape(node.question)}</b><ul>{''.join(items)}</ul></li></ul>"


def _inline_png(path: str, caption: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    return (f"<figure><img alt='{html.escape(os.path.basename(path))}' src='data:image/png;base64,{data}'>"
            f"<figcaption class='caption'>{html.escape(caption)}</figcaption></figure>")


def html_page(report: Report) -> str:
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'><title>rlhf-bench report</title>",
             f"<style>{CSS}</style></head><body><h1>rlhf-bench report</h1>",
             f"<p>{html.escape(_compared(report))}</p><h2 id='answer'>The answer</h2><ul>"]
    parts += [f"<li>{html.escape(a)}</li>" for a in _answers(report)]
    parts.append(f"</ul><p>{html.escape(_claim_counts(report))} (<a href='#claims-check'>the claims check</a>)</p>")
    parts += [_inline_png(f.path, f"Figure {n}. {f.caption}") for n, f in _key_figures(report)]
    contents = ([(t.key, t.title) for t in report.environment + report.tables]
                + [("figures", "Figures"), ("decision", "Decision tree"), ("claims-check", "Claims check")])
    parts.append("<nav>Contents: " + " · ".join(f"<a href='#{k}'>{html.escape(t)}</a>" for k, t in contents)
                 + "</nav>")
    parts += [f"<p>{html.escape(line.replace('`', '').replace('[table.csv](table.csv)', 'table.csv'))}</p>"
              for line in _summary(report)]
    parts.append("<p><a href='table.csv'>table.csv</a>: every stage row with its units in the column names.</p>")
    if report.collection.problems:
        parts.append("<h2>Skipped record files</h2><ul>")
        parts += [f"<li><code>{html.escape(p.path)}</code>: {html.escape(p.reason)}</li>"
                  for p in report.collection.problems]
        parts.append("</ul>")
    parts.append("<h2>Environment</h2>")
    parts += [_html_table(t) for t in report.environment]
    parts.append("<h2>Tables</h2><p class='caption'>Each table's figures follow it; those of the answer are not "
                 "repeated.</p>")
    for table in report.tables:
        parts.append(_html_table(table))
        parts += [_inline_png(f.path, f"Figure {n}. {f.caption}") for n, f in _figures_after(report, table.key)]
    rest = _figures_after(report, None)
    parts.append("<h2 id='figures'>Figures</h2>")
    parts += ([_inline_png(f.path, f"Figure {n}. {f.caption}") for n, f in rest] if rest
              else ["<p class='caption'>Every figure is shown beside its table, or under the answer.</p>"])
    parts.append("<h2 id='decision'>Decision tree</h2><p class='caption'>Built from the measured rows; a leaf that "
                 "the data cannot decide says so.</p>")
    parts.append(_html_tree(report.tree))
    parts.append("<h3>As plain questions</h3><ul>")
    parts += [f"<li>{html.escape(q[2:])}</li>" for q in _plain_questions(report.tree)]
    parts.append(f"</ul><h2 id='claims-check'>Claims check</h2><p class='caption'>{html.escape(UNITS)}</p>"
                 f"<p class='caption'>{html.escape(VERDICT_RULE)}</p>")
    claims = Table("claims", "Published claims", "Each claim of the two articles (conf/claims.yaml, listed with "
                   "their sources in the docs' Published claims page) against this sweep's measurements.",
                   ["claim", "statement", "verdict", "evidence"],
                   [[v.claim_id, v.claim, v.verdict, v.evidence] for v in report.claims])
    parts.append(_html_table(claims))
    parts.append(f"<p class='caption'><b>Caveat.</b> {html.escape(report.caveat)}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_flat(rows: list[dict[str, Any]], directory: str) -> list[str]:
    """The flat table as CSV and Parquet (one row per run and stage, units in the column names)."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    csv_path, parquet_path = os.path.join(directory, "table.csv"), os.path.join(directory, "table.parquet")
    frame.to_csv(csv_path, index=False)
    frame.to_parquet(parquet_path, index=False)
    return [csv_path, parquet_path]
