"""The docs check: every relative link in README.md and docs/ resolves, and every command marked runnable runs.

A fenced block preceded by ``<!-- runnable -->`` runs as written (a ``python`` block as a script of its own, forked
from an interpreter that imported torch and Lightning already: [Note: forked ranks] in tests/forked.py); one
preceded by ``<!-- runnable: COMMAND -->`` runs COMMAND instead, the reduced form of the block (fewer steps, a
scratch directory). Commands run with bash from the
repository's root, ``$SCRATCH`` a fresh directory, ``.venv/bin`` the interpreter running the tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
MARK = re.compile(r"^<!--\s*runnable(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^```")
PYTHON = "# a python block"  # what _runnable puts before a python block's text


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but hyphens and underscores dropped."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def _links() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code are code
        for target in LINK.findall(text):
            if not re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                found.append((str(page.relative_to(ROOT)), target))
    return found


@pytest.mark.parametrize(("page", "target"), _links())
def test_every_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    dest = (ROOT / page).parent / path if path else ROOT / page
    assert dest.exists(), f"{page}: the link {target!r} points at {dest}, which does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{page}: the link {target!r} names no heading of {path or page}"


def _notes_in_source() -> set[str]:
    """The ``[Note: NAME]`` blocks of the package: a line that starts with the name (after ``#`` or ``\"\"\"``)."""
    start = re.compile(r'\s*(?:#\s*|r?""")?\[Note: ([^\]]+)\]')
    return {
        m.group(1)
        for f in (ROOT / "lightning_chunk").rglob("*.py")
        for m in map(start.match, f.read_text().splitlines())
        if m
    }


def test_every_note_the_docs_name_is_in_the_source():
    """The docs point at ``[Note: ...]`` blocks for the detail: a renamed or dropped note leaves a dead pointer."""
    notes = _notes_in_source()
    named = [
        (page.name, " ".join(n.split())) for page in PAGES for n in re.findall(r"\[Note: ([^\]]+)\]", page.read_text())
    ]
    missing = [f"{page}: [Note: {n}]" for page, n in named if n not in notes and n != "…"]
    assert named and not missing, missing


def _runnable() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = MARK.match(line)
            if m is None:
                continue
            assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), f"{page.name}:{i + 1}: a mark needs a block"
            end = next(j for j in range(i + 2, len(lines)) if FENCE.match(lines[j]))
            block = "\n".join(lines[i + 2 : end])
            if m.group(1) is None and lines[i + 1].strip() == "```python":  # a Python block runs as a script
                block = f"{PYTHON}\n{block}"
            found.append((f"{page.relative_to(ROOT)}:{i + 1}", m.group(1) or block))
    return found


def test_the_marks_are_found():
    """The README's quick starts are marked: a check that finds nothing checks nothing."""
    assert sum(where.startswith("README.md") for where, _ in _runnable()) >= 2


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("where", "command"), _runnable())
def test_every_runnable_command_runs(where, command, tmp_path):
    bindir = Path(sys.executable).parent
    env = {**os.environ, "SCRATCH": str(tmp_path), "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    if command.startswith(PYTHON):
        script = tmp_path / "block.py"
        script.write_text(command.removeprefix(PYTHON))
        r = forked.run([sys.executable, str(script)], env=env, cwd=ROOT, timeout=900)
        assert r.returncode == 0, f"{where} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return
    script = command.replace(".venv/bin/", f"{bindir}/")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"{where}: `{command}` exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def test_the_readme_and_the_results_page_stay_short():
    """A user reads the README in five minutes, docs/ in an hour; the results page holds the latest tables."""
    assert len((ROOT / "README.md").read_text().split()) <= 1200
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 400
    words = {page.name: len(page.read_text().split()) for page in (ROOT / "docs").glob("*.md")}
    assert sum(words.values()) <= 15_000, words


def test_one_results_file_a_benchmark():
    """``benchmarks/results/`` keeps the latest JSON of each script, nothing superseded (git keeps the history)."""
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    files = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    assert all(Path(f).stem in scripts for f in files), files


def test_no_numbered_work_periods():
    """The project names dates and commits, never the numbered work periods it was built in."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    period = re.compile(r"\bsessions? \d+|_s\d\d\b")
    found = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in (".py", ".md", ".json", ".yaml", ".toml", ".txt") and path.is_file():
            found += [f"{name}: {m.group()}" for m in period.finditer(f"{name}\n{path.read_text(errors='ignore')}")]
    assert not found, found
