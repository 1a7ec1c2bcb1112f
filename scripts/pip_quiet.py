"""Set-up's filter for pip's output: every line into a log, only what needs the reader on the terminal.

    pip install ... 2>&1 | python scripts/pip_quiet.py LOG      filter stdin (a line at a time) into LOG
    python scripts/pip_quiet.py --summary LOG                     one plain line on what set-up left out

What stays off the terminal (and in LOG): pip's dependency-resolver report about colossalai 0.5.0, which
set-up installs without the requirements it declares but never imports here and beside a torch newer than
the one it declares (scripts/setup.sh says why); setuptools' warning about editable installs; pip's notices
about a newer pip and about this machine's missing local package indexes. Everything else reaches the
terminal as pip wrote it, and a resolver complaint about any other package is shown in plain words: it is
a real problem. Standard library only: it runs before the project is installed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator
from typing import TextIO

RESOLVER_HEADER = "ERROR: pip's dependency resolver does not currently take into account"
# "<package> <version> requires <requirement>, which is not installed." or "..., but you have ... incompatible."
CONFLICT = re.compile(r"^(?P<package>[A-Za-z0-9_.\-]+) (?P<version>\S+) requires (?P<requirement>.+?), "
                      r"(?P<why>which is not installed\.|but you have (?P<have>.+) which is incompatible\.)$")
EXPECTED_PACKAGE = ("colossalai", "0.5.0")
EDITABLE_START = "BuildBackendWarning: Editable installation."
EDITABLE_END = "WheelFile("
NOISE = (re.compile(r"^WARNING: Location "), re.compile(r"^\s*\[notice\] "))


def is_expected(line: str) -> bool:
    """A resolver line about colossalai 0.5.0, which set-up installs without its dependencies on purpose."""
    match = CONFLICT.match(line.strip())
    return bool(match) and (match["package"], match["version"]) == EXPECTED_PACKAGE


def shown(lines: Iterable[str]) -> Iterator[str]:
    """The lines of pip's output a reader needs to see; a resolver report is reduced to its unexpected
    complaints, each said plainly (without pip's ERROR header, which is about colossalai's on purpose)."""
    in_report = in_editable = False
    for line in lines:
        text = line.rstrip("\n")
        if in_editable:
            in_editable = EDITABLE_END not in text
            continue
        if EDITABLE_START in text:
            in_editable = True
            continue
        if text.startswith(RESOLVER_HEADER):
            in_report = True
            continue
        if in_report:
            if CONFLICT.match(text.strip()):
                if not is_expected(text):
                    yield f"setup: pip reports a dependency conflict: {text.strip()}"
                continue
            in_report = False
        if any(pattern.match(text) for pattern in NOISE):
            continue
        yield text


def left_out(log_lines: Iterable[str]) -> tuple[list[str], list[str]]:
    """From a log: colossalai's declared requirements that are not installed, and what is installed at a
    version it does not declare ("torch 2.13.0+cpu where it asks torch<=2.5.1,>=2.2.0"), each once, in the
    order pip named them."""
    missing: list[str] = []
    other: list[str] = []
    for line in log_lines:
        match = CONFLICT.match(line.strip())
        if not match or not is_expected(line):
            continue
        if match["have"] is None:
            entry, bucket = match["requirement"], missing
        else:
            entry, bucket = f"{match['have']} (it asks {match['requirement']})", other
        if entry not in bucket:
            bucket.append(entry)
    return missing, other


def summary(log_lines: Iterable[str], log_path: str) -> str | None:
    missing, other = left_out(log_lines)
    if not missing and not other:
        return None
    parts = []
    if missing:
        parts.append(f"without {len(missing)} requirements it declares but never imports here ({', '.join(missing)})")
    if other:
        parts.append(f"beside {'; '.join(other)}, which the adapter bridges")
    return (f"setup: colossalai 0.5.0 installed {' and '.join(parts)}, on purpose (scripts/setup.sh); "
            f"pip's report: {log_path}")


def filter_stream(source: TextIO, log: TextIO, terminal: TextIO) -> None:
    def logged() -> Iterator[str]:
        for line in source:
            log.write(line)
            log.flush()
            yield line

    for line in shown(logged()):
        terminal.write(line + "\n")
        terminal.flush()


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--summary":
        with open(argv[1]) as f:
            line = summary(f, argv[1])
        if line:
            print(line)
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], "a") as log:
        filter_stream(sys.stdin, log, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
