"""Writes the report: Markdown, one self-contained HTML page (figures inlined), CSV and Parquet."""

from __future__ import annotations

import base64
import html
import os
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


def markdown(report: Report) -> str:
    lines = ["# rlhf-bench report", ""] + _summary(report) + ["", "## Environment", ""]
    for table in report.environment:
        lines += _md_table(table)
    if report.collection.problems:
        lines += ["## Skipped record files", ""]
        lines += [f"- `{p.path}`: {p.reason}" for p in report.collection.problems] + [""]
    lines += ["## Tables", ""]
    for table in report.tables:
        lines += _md_table(table)
    lines += ["## Figures", ""]
    for n, figure in enumerate(report.plots, 1):
        lines += [f"![{os.path.basename(figure.path)}](plots/{os.path.basename(figure.path)})", "",
                  f"*Figure {n}.* {figure.caption}", ""]
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
                "classification", "statement", "verdict", "evidence", "claim", "other config", "engine", "notes",
                "tags", "configuration", "pair", "largest difference", "term", "finetune", "model", "cell",
                "what", "value", "code", "host", "provenance", "records", "command", "seeds"}


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
    return (f"<h3 id='{table.key}'>{html.escape(table.title)}</h3><p class='caption'>{html.escape(table.caption)}</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


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
             f"<style>{CSS}</style></head><body><h1>rlhf-bench report</h1>"]
    parts += [f"<p>{html.escape(line.replace('`', '').replace('[table.csv](table.csv)', 'table.csv'))}</p>"
              for line in _summary(report)]
    parts.append("<p><a href='table.csv'>table.csv</a>: every stage row with its units in the column names.</p>")
    contents = ([(t.key, t.title) for t in report.environment + report.tables]
                + [("figures", "Figures"), ("decision", "Decision tree"), ("claims-check", "Claims check")])
    parts.append("<nav>Contents: " + " · ".join(f"<a href='#{k}'>{html.escape(t)}</a>" for k, t in contents)
                 + "</nav>")
    if report.collection.problems:
        parts.append("<h2>Skipped record files</h2><ul>")
        parts += [f"<li><code>{html.escape(p.path)}</code>: {html.escape(p.reason)}</li>"
                  for p in report.collection.problems]
        parts.append("</ul>")
    parts.append("<h2>Environment</h2>")
    parts += [_html_table(t) for t in report.environment]
    parts.append("<h2>Tables</h2>")
    parts += [_html_table(t) for t in report.tables]
    parts.append("<h2 id='figures'>Figures</h2>")
    parts += [_inline_png(f.path, f"Figure {n}. {f.caption}") for n, f in enumerate(report.plots, 1)]
    parts.append("<h2 id='decision'>Decision tree</h2><p class='caption'>Built from the measured rows; a leaf that "
                 "the data cannot decide says so.</p>")
    parts.append(_html_tree(report.tree))
    parts.append("<h3>As plain questions</h3><ul>")
    parts += [f"<li>{html.escape(q[2:])}</li>" for q in _plain_questions(report.tree)]
    parts.append(f"</ul><h2 id='claims-check'>Claims check</h2><p class='caption'>{html.escape(UNITS)}</p>"
                 f"<p class='caption'>{html.escape(VERDICT_RULE)}</p>")
    claims = Table("claims", "Published claims", "Each claim of the two articles (shared/reference/"
                   "published-claims.md) against this sweep's measurements.", ["claim", "statement", "verdict",
                                                                                "evidence"],
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
