"""The commands the README and the documentation pages show, read from the pages as they now read, and how
tests/test_docs_commands.py runs each one.

A command is a line of a code block, or an inline code span outside code blocks, that starts with an
invocation: `python -m MODULE`, `python FILE.py`, `bash FILE.sh`, `mkdocs VERB` (`.venv/bin/` and leading
`NAME=value` settings allowed). A trailing `# comment` is dropped, a `\\`-continued line is joined, `a && b`
is two commands. A usage synopsis (a command whose arguments are `[optional]` and `a|b|c` alternatives) is
checked option by option instead of run. Placeholders a page uses for a value the reader chooses (`DIR`,
`<name>`, `...`) are filled in by the runner. `pip install` lines describe what scripts/setup.sh runs (and
tests/test_dependencies.py, in a fresh venv): they are not read as commands here.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INVOCATION = re.compile(
    r"^(?:[A-Z][A-Z0-9_]*=\S*\s+)*(?:\.venv/bin/)?(?:python3?\s+(?:-m\s+[\w.]+|\S+\.py)|bash\s+\S+\.sh|mkdocs\s+\w+)")
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+){0,3})`")


@dataclass(frozen=True)
class Shown:
    """One command as a page shows it, normalised (`.venv/bin/` and `python3` dropped, spaces collapsed)."""
    text: str
    page: str  # relative to the repository
    line: int

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def is_usage(self) -> bool:
        """A synopsis: `[key=a|b]` options rather than one command line."""
        return bool(re.search(r"\[[^\]]*\|[^\]]*\]", self.text))


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _strip_comment(text: str) -> str:
    return re.split(r"\s+#\s", text, maxsplit=1)[0].strip()


def normalise(text: str) -> list[str]:
    """The commands in one shown line: comments dropped, `&&` split, `.venv/bin/` and `python3` made plain."""
    out = []
    for part in _strip_comment(" ".join(text.split())).split("&&"):
        part = re.sub(r"(?<![\w/])\.venv/bin/", "", part.strip())
        part = re.sub(r"\bpython3\b", "python", part)
        if part and INVOCATION.match(part):
            out.append(part)
    return out


def _code_block_lines(lines: list[str]) -> set[int]:
    """Indices of the lines inside code blocks: fenced, or indented by 4 spaces after a blank line."""
    inside: set[int] = set()
    fenced = indented = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            inside.add(i)
            continue
        if fenced:
            inside.add(i)
            continue
        blank_before = i == 0 or not lines[i - 1].strip()
        if line.startswith("    ") and (indented or blank_before):
            indented = True
            inside.add(i)
        elif line.strip():
            indented = False
    return inside


def extract(text: str, page: str) -> list[Shown]:
    """Every command a page shows, in page order."""
    lines = text.split("\n")
    block = _code_block_lines(lines)
    found: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        if i in block and INVOCATION.match(lines[i].strip()):
            start, joined = i, lines[i].strip()
            while joined.endswith("\\") and i + 1 < len(lines):  # a continued line
                i += 1
                joined = joined[:-1] + " " + lines[i].strip()
            # a synopsis wraps its options onto deeper-indented lines that open with "["
            while i + 1 in block and lines[i + 1].strip().startswith("[") and \
                    len(lines[i + 1]) - len(lines[i + 1].lstrip()) > 4:
                i += 1
                joined += " " + lines[i].strip()
            found.append((start + 1, joined))
        i += 1
    prose = "\n".join("" if i in block else line for i, line in enumerate(lines))
    for match in INLINE.finditer(prose):
        span = " ".join(match.group(1).split())
        if INVOCATION.match(span):
            found.append((prose.count("\n", 0, match.start()) + 1, span))
    found.sort()
    return [Shown(cmd, page, line) for line, text_ in found for cmd in normalise(text_)]


def shown_commands() -> list[Shown]:
    """Every command of every page, each distinct command once (at its first place)."""
    seen: dict[str, Shown] = {}
    for path in pages():
        for shown in extract(path.read_text(), str(path.relative_to(REPO))):
            seen.setdefault(shown.text, shown)
    return list(seen.values())


def usage_options(shown: Shown) -> list[tuple[str, list[str]]]:
    """A synopsis's options: (key, its alternatives), e.g. ("zero", ["0", "1", "2", "3"]); flags have no value."""
    options = []
    for bracket in re.findall(r"\[([^\]]+)\]", shown.text):
        key, sep, values = bracket.partition("=")
        options.append((key, values.split("|") if sep else []))
    return options
