"""Every test file the documentation, CI scripts, scripts, benchmarks and source name
(``tests/.../test_x.py``, or a ``*`` pattern of them) exists: moving or splitting a test
file without updating the pages that cite it fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"\btests/[\w/*.-]*?\.py\b")


def _citing_files():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").rglob("*.md"))
    yield from sorted(p for p in (ROOT / ".ci").iterdir() if p.is_file())
    for folder in ("scripts", "benchmarks", "src"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_cited_test_file_exists():
    missing = []
    for path in _citing_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            for cited in CITED.findall(line):
                if not list(ROOT.glob(cited)):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {cited}")
    assert not missing, "\n".join(missing)


def test_the_check_sees_a_missing_file(tmp_path):
    assert CITED.findall("see `tests/logs/test_gone.py` and tests/evaluate/test_faults_eval_*.py.") == [
        "tests/logs/test_gone.py", "tests/evaluate/test_faults_eval_*.py"]
    assert not list(ROOT.glob("tests/logs/test_gone.py")) and list(ROOT.glob("tests/evaluate/test_faults_eval_*.py"))


SECTION = re.compile(r'(?<![\w/])(README(?:\.md)?|docs/[\w-]+\.md),? "([^"]+)"')
"""A pointer to a section of ours: ``README "The CLI"``, ``(docs/running.md, "Outputs")``
(not another project's ``swe_agents/README "..."``)."""


def _headings(page: Path) -> set[str]:
    return {line.lstrip("#").strip().replace("`", "") for line in page.read_text().splitlines() if line.startswith("#")}


def test_every_section_a_config_or_source_points_to_exists():
    """Issue 44: the closed configs pointed to a README section that had moved to docs/."""
    files = [*sorted((ROOT / "configs").glob("*.yaml")), *(p for p in _citing_files() if p.suffix == ".py")]
    wrong = []
    for path in files:
        text = " ".join(path.read_text(errors="replace").split())  # a pointer may wrap
        for page, section in SECTION.findall(text):
            target = ROOT / ("README.md" if page.startswith("README") else page)
            if not target.is_file() or section.replace("`", "") not in _headings(target):
                wrong.append(f"{path.relative_to(ROOT)}: {page} \"{section}\"")
    assert not wrong, "\n".join(wrong)
