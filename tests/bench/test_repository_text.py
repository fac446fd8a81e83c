"""The repository speaks of the project only, and its benchmark docs stay true:
- no file refers to the numbered sittings the work was done in ("the thirteenth ...", "earlier
  ...s' runs"): results
  carry dates, versions, commits or measured figures (the corpus' gRPC ``Session`` stream, and the
  sessions a server counts, are the project's own and stay);
- every ``bench/*.py`` that README.md or docs/*.md names exists, and every runnable benchmark has
  its section, with a command, in docs/benchmarks.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Output and tool folders that are not the project's text (git-ignored).
SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", ".model", ".whl", ".gl",
             "out", "results"}

_W = "sess" + "ion"  # spelled apart so that this file's own patterns do not match themselves
_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\\d+(?:st|nd|rd|th)")
WORK_SESSION = re.compile("|".join((
    rf"\b(?:{_ORDINALS})[ -]+{_W}s?\b",                               # "the ninth ...", "13th ..."
    rf"\b(?:this|that|earlier|previous|next|same|later|work)[ -]+{_W}s?\b",  # "this ...'s runs"
    rf"\b{_W}s'",                                                      # "earlier ...s' runs", "other ...s' jobs"
    rf"\bover (?:two|three|four|five|six|seven|eight|nine|ten|\d+) {_W}s\b",
)), re.IGNORECASE)


def repository_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (git), else a walk that skips the output folders."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                             capture_output=True, check=True, timeout=60).stdout
        files = [REPO / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        files = [p for p in REPO.rglob("*") if not SKIP_DIRS.intersection(p.relative_to(REPO).parts)]
    return [p for p in files if p.is_file()]


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@pytest.mark.parametrize("phrase", [
    "the thirteenth " + _W + "'s run", "Tenth " + _W + ": a request", "earlier " + _W + "s' runs gave",
    "shared with other " + _W + "s' jobs", "in this " + _W, "the same " + _W + "'s run",
    "over four " + _W + "s", "the 12th " + _W,
])
def test_the_pattern_finds_work_session_phrases(phrase):
    assert WORK_SESSION.search(phrase), phrase


@pytest.mark.parametrize("phrase", [
    "C clients (one Session each", "a Session step's in-band error", "20 sessions each starting 5,000 requests",
    "the budget refusing across two sessions", "balances sessions round-robin", "drains open sessions",
    "Started when a Session stream or a BatchGet call arrives", "never started on this stream",
])
def test_the_pattern_leaves_the_grpc_session_alone(phrase):
    assert not WORK_SESSION.search(phrase), phrase


def test_no_file_refers_to_work_sessions():
    hits = []
    for path in repository_files():
        text = text_of(path)
        if text is None:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            m = WORK_SESSION.search(line)
            if m:
                hits.append(f"{path.relative_to(REPO)}:{no}: {m.group(0)!r} in {line.strip()[:120]!r}")
    assert not hits, "references to sittings of work (write dates, commits or figures instead):\n" + "\n".join(hits)


BENCH_SCRIPT = re.compile(r"(?<![\w/])bench/([A-Za-z0-9_]+\.py)\b")
CURRENT_DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", CURRENT_DOCS)
def test_docs_name_only_benchmark_scripts_that_exist(doc):
    """docs/history/ is exempt: it records commands of scripts since removed, with their commit."""
    text = (REPO / doc).read_text()
    missing = sorted({m.group(1) for m in BENCH_SCRIPT.finditer(text)} - {p.name for p in (REPO / "bench").glob("*.py")})
    assert not missing, f"{doc} names bench scripts that do not exist: {missing}"


def test_benchmarks_md_commands_run_existing_scripts_and_cover_every_benchmark():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = [ln.strip() for b in blocks for ln in b.splitlines() if re.match(r"\s*python3? ", ln)]
    assert commands, "docs/benchmarks.md has no python3 commands in ```bash blocks"
    run = set()
    for cmd in commands:
        m = re.match(r"python3? (?:-m venv .*|(\S+\.py)|(-m \S+))", cmd)
        assert m, f"unexpected command form: {cmd}"
        if m.group(1):
            assert (REPO / m.group(1)).is_file(), f"docs/benchmarks.md runs {m.group(1)}, which does not exist"
            run.add(Path(m.group(1)).name)
    runnable = {p.name for p in (REPO / "bench").glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    assert not runnable - run, f"benchmarks without a command in docs/benchmarks.md: {sorted(runnable - run)}"


def test_benchmarks_md_stays_short_with_the_targets_first():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) < 400
    assert re.findall(r"(?m)^## (.+)$", text)[0] == "Targets"
