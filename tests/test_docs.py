"""Every shell, Python and TOML block of the README and the guides runs as printed.

A document's blocks run in order as one bash script in a fresh directory that is also
``$HOME`` (a tutorial's later blocks use what its earlier ones made), with the
project's ``ciuic-node`` and ``python`` first on ``PATH`` (and ``.venv`` there, as in a
checkout after ``make``) and no ``CIUIC_*`` variable of the test's own environment. A block is

- ``sh``/``bash``: run as is (``set -e``: a failing command fails the document);
- ``python``: run with ``python``, or written to a file when the line before it is
  ``<!-- file: NAME -->`` (a later shell block runs it);
- ``toml``: written to the file its marker names, else checked as a node config;
- skipped when the line before it is ``<!-- not-run: REASON -->`` (systemd, apt: the
  reason is required), or when it only runs ``make test``/``make demo`` (CI runs those).

Processes a document leaves in the background are ended with the script's process
group when it is done (only what the test started). Each document is bounded in time.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ciuic_p2p.config import config_from_toml

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs" / "guides").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*(file|not-run):\s*(.*?)\s*-->\s*$")
LANGUAGES = ("sh", "bash", "python", "toml")
TIME_LIMIT_S = 280.0
"""Under the suite's own 300 s per test, so a hung document fails with its output."""


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    language: str
    text: str
    file: str | None
    not_run: str | None

    @property
    def where(self) -> str:
        name = self.doc.relative_to(REPO) if self.doc.is_relative_to(REPO) else self.doc.name
        return f"{name}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        marker = MARKER.match(lines[start - 1]) if start else None
        kind, value = (marker.group(1), marker.group(2)) if marker else (None, None)
        found.append(
            Block(
                doc,
                start + 1,
                m.group(1),
                "\n".join(lines[start + 1 : j]) + "\n",
                value if kind == "file" else None,
                value if kind == "not-run" else None,
            )
        )
        i = j + 1
    return found


def ci_runs_it(block: Block) -> bool:
    commands = [
        line.split("#")[0].strip() for line in block.text.splitlines() if line.split("#")[0].strip()
    ]
    return bool(commands) and all(c in ("make test", "make demo") for c in commands)


def script_of(doc: Path) -> tuple[str, list[Block]]:
    """The bash script a document's blocks make, and the blocks it left out."""
    parts = ["set -euo pipefail"]
    skipped = []
    for n, b in enumerate(blocks(doc)):
        if b.language not in LANGUAGES:
            continue
        if b.not_run is not None or ci_runs_it(b):
            skipped.append(b)
            continue
        tag = f"CIUIC_DOC_BLOCK_{n}"
        parts.append(f"echo '>>> {b.where}' >&2")
        if b.file is not None:
            parts.append(f"cat > {b.file} <<'{tag}'\n{b.text}{tag}")
        elif b.language == "python":
            parts.append(f"python - <<'{tag}'\n{b.text}{tag}")
        elif b.language == "toml":
            config_from_toml(b.text, b.where)  # a node config, valid as printed
        else:
            parts.append(b.text)
    return "\n".join(parts) + "\n", skipped


def test_every_skipped_block_says_why() -> None:
    for doc in DOCUMENTS:
        for b in blocks(doc):
            if b.not_run is not None:
                assert b.not_run, f"{b.where}: not-run needs a reason"
            assert b.language in (*LANGUAGES, "text", "console", "json", "ini"), (
                f"{b.where}: a block in {b.language!r} would not be checked"
            )


def test_the_harness_fails_a_document_whose_block_fails(tmp_path: Path) -> None:
    doc = tmp_path / "bad.md"
    doc.write_text("```sh\necho ok\n```\n\n```python\nraise SystemExit(4)\n```\n")
    script, _ = script_of(doc)
    assert run_script(script, tmp_path / "work").returncode == 4


def run_script(script: str, work: Path) -> subprocess.CompletedProcess[str]:
    work.mkdir(parents=True, exist_ok=True)
    # As in a checkout after `make`: the environment the suite runs in is its .venv.
    (work / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("CIUIC_")}
    env |= {
        "HOME": str(work),
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    # Output to a file, not a pipe: a document that fails while something it started
    # in the background still runs (a daemon holds the pipe open) must end with its
    # output at once, not wait for the pipe's end until the suite's timeout.
    output = work.parent / f"{work.name}-output.txt"
    with output.open("w") as out_file:
        proc = subprocess.Popen(
            ["bash", "-c", script],
            cwd=work,
            env=env,
            stdout=out_file,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=TIME_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = 124
        finally:
            # What the document left running in the background: its own process group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    out = output.read_text(errors="replace")
    if returncode == 124:
        out += "\n[timed out]"
    return subprocess.CompletedProcess(proc.args, returncode, out)


@pytest.mark.processes
@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_documents_blocks_run_as_printed(doc: Path, tmp_path: Path) -> None:
    script, _ = script_of(doc)
    done = run_script(script, tmp_path / "work")
    assert done.returncode == 0, done.stdout[-6000:]


@pytest.mark.timeout(60)
def test_a_failing_document_ends_though_its_background_jobs_run(tmp_path: Path) -> None:
    doc = tmp_path / "bad.md"
    doc.write_text("```sh\nsleep 600 &\nfalse\n```\n")
    script, _ = script_of(doc)
    assert run_script(script, tmp_path / "work").returncode == 1


README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
SUMMARY = re.compile(r"^<!-- summary(?::[^>]*)? -->\n(.*?)^<!-- summary end -->$", re.M | re.S)
RESULTS = re.compile(r"^<!-- results(?::[^>]*)? -->\n(.*?)^<!-- results end -->$", re.M | re.S)
FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)?")


def marked(pattern: re.Pattern[str], doc: Path) -> str:
    """The lines between ``doc``'s begin and end markers that ``pattern`` names."""
    found = pattern.search(doc.read_text(encoding="utf-8"))
    name = pattern.pattern.split()[1].split("(")[0]
    assert found, f"{doc.relative_to(REPO)}: no <!-- {name} --> ... <!-- {name} end --> block"
    return found.group(1)


def test_the_readme_results_are_the_benchmarks_summary() -> None:
    """One source: the README's results are docs/benchmarks.md's summary, its links
    made relative to the README (docs/generate_reference.py copies it)."""
    summary = marked(SUMMARY, BENCHMARKS)
    assert marked(RESULTS, README) == summary.replace("](#", "](docs/benchmarks.md#")


def test_every_figure_of_the_benchmarks_summary_is_measured_below_it() -> None:
    """The summary quotes the sections, which give each figure's command and commit: a
    number in the summary that no section holds was typed, not measured."""
    text = BENCHMARKS.read_text(encoding="utf-8")
    summary = marked(SUMMARY, BENCHMARKS)
    body = FIGURE.findall(text.replace(summary, ""))
    # Anchors (`#...-2026-12-03-...`) are names, not figures.
    quoted = FIGURE.findall(re.sub(r"\]\([^)]*\)", "]", summary))
    assert quoted and not [f for f in quoted if f not in body]


PROCESS_WORDS = re.compile(
    r"\bthe issue\b|\bissue's\b|\bissues? ?\d+|\bissue-\d+|\bthis stop\b|\bstop's\b"
    r"|closing note|\bwas lent\b|\blent to\b|\bin one session\b",
    re.I,
)


def test_the_docs_speak_to_users_not_of_the_projects_process() -> None:
    """Who worked on what, under which ticket, is the commits' and the changelog's
    history; a reader of the docs has none of that context."""
    docs = [README, REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = [
        f"{doc.relative_to(REPO)}:{n}: {m.group(0)!r}"
        for doc in docs
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
        for m in PROCESS_WORDS.finditer(line)
    ]
    assert not found, "\n".join(found)


def test_each_duration_the_contributor_notes_give_says_where_it_was_measured() -> None:
    """How long a make target takes depends on the machine and grows with the suite:
    a duration with no machine and date is a guess that goes stale unseen."""
    notes = (REPO / "docs" / "index.md").read_text(encoding="utf-8")
    items = notes.split("## For contributors", 1)[1].split("\n- ")
    timed = [i for i in items if re.search(r"\bminutes?\b|\bseconds\b|\d s\b", i)]
    for item in timed:
        flat = " ".join(item.split())
        assert re.search(r"on (?:2|two) cores|build machine", flat), flat
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", flat), flat
