"""Measured figures live in one place, docs/performance.md (each with its date, commit and
machine), and the user docs speak of the product, not of how it is made (issue #56: figures had
been copied into five pages and drifted apart; the README's status read like a lab notebook).

- No measured figure appears on two doc pages: every time, rate, energy or memory figure that is
  a range or has three significant digits, found on more than one page, fails (a round setting
  such as "5 s" is not such a figure).
- The key figures once repeated are on docs/performance.md only; the reference result, 98,208 /
  110,000, is the README's (and the per-draw table's in docs/learner.md); the first GPU run's date
  is on the README's status and docs/performance.md.
- The README stays under 130 lines, its Status under 9; no user page speaks of sessions, lent
  machines or the next GPU run; docs/sweeps.md and docs/evaluations.md open with what they offer.
- The service's own comments and docstrings quote no measured milliseconds: they point at
  docs/performance.md.
"""

from __future__ import annotations

import io
import re
import tokenize

import pytest

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "deploy" / "README.md", ROOT / "data" / "README.md"]
PERFORMANCE = ROOT / "docs" / "performance.md"
USER_PAGES = [p for p in PAGES if p.name != "development.md"]  # (development.md: how the project works)

UNIT = r"(?:ms|µs|s|cells/s|tasks/s|mJ|J|W|KB|kB|MB|GB|KiB|MiB|GiB|×|TFLOP/s)"
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.\-/]){NUMBER}(?:\s?[–-]\s?{NUMBER})?\s?{UNIT}(?![\w/])")


def significant(number: str) -> int:
    return len(number.replace(",", "").replace(".", "").lstrip("0"))


def measured_figures(text: str) -> set[str]:
    """The figures of ``text`` that read as measurements: a range (``761–848 cells/s``), or a
    decimal of three significant digits or more (``59.98 ms``, ``4.88 s``), spaces removed."""
    found = set()
    for match in FIGURE.finditer(text):
        figure = re.sub(r"\s", "", match.group(0))
        numbers = re.findall(NUMBER, figure)
        ranged = len(numbers) > 1
        if ranged or any("." in n and significant(n) >= 3 for n in numbers):
            found.add(figure)
    return found


def test_the_figures_are_found():
    figures = measured_figures("took 59.98 ms, 761–848 cells/s at 0.82–1.25 ms, 4.88 s; 5 s, 60 s, 2 GiB, 0.5 s")
    assert figures == {"59.98ms", "761–848cells/s", "0.82–1.25ms", "4.88s"}


def test_no_measured_figure_is_on_two_pages():
    where: dict[str, set[str]] = {}
    for page in PAGES:
        for figure in measured_figures(page.read_text()):
            where.setdefault(figure, set()).add(page.relative_to(ROOT).as_posix())
    repeated = {f: sorted(p) for f, p in where.items() if len(p) > 1}
    assert not repeated, f"measured figures on more than one page (keep them in docs/performance.md): {repeated}"


@pytest.mark.parametrize("figure", ["59.98", "34.27", "0.281", "236 cells/s", "4.88 s", "1,018–1,101", "51.07",
                                    "5.64 GB", "44.1 ms"])
def test_a_key_figure_is_on_the_performance_page_only(figure):
    on = [p.relative_to(ROOT).as_posix() for p in PAGES if figure in p.read_text()]
    assert on == ["docs/performance.md"], f"{figure!r} is on {on}"


@pytest.mark.parametrize("summary", ["761–848", "0.82–1.25"])
def test_a_summary_of_runs_that_drifted_is_gone(summary):
    """Ranges over several runs, once copied into the README and docs/sweeps.md: the runs
    themselves are in docs/performance.md's table, and no page restates them."""
    assert not [p.name for p in PAGES if summary in p.read_text()]


def test_the_reference_result_and_the_gpu_runs_date_where_they_belong():
    with_result = sorted(p.relative_to(ROOT).as_posix() for p in PAGES if "98,208" in p.read_text())
    assert with_result == ["README.md", "docs/learner.md"]  # the product's result; the per-draw table's total
    with_date = sorted(p.relative_to(ROOT).as_posix() for p in PAGES if "2026-12-04" in p.read_text())
    assert set(with_date) <= {"README.md", "docs/performance.md", "CHANGELOG.md"} and "README.md" in with_date


def test_the_readme_is_short_and_its_status_is_for_users():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 130
    status = readme.split("\n## Status\n", 1)[1].split("\n## ", 1)[0].strip().splitlines()
    assert 0 < len(status) <= 8, status
    assert "docs/performance.md" in "\n".join(status) and "H200" in "\n".join(status)
    assert not measured_figures("\n".join(status)), "measured figures belong to docs/performance.md"


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_user_page_does_not_speak_of_how_the_project_is_made(page):
    text = page.read_text()
    for words in (r"\bsessions?\b(?!_attrs)", r"\blent\b", r"\bthe next GPU\b", r"tasks lent"):
        found = re.search(words, text, re.I)
        assert not found, f"{page.name}: {found.group(0)!r} ({text[max(0, found.start() - 60):found.end() + 60]!r})"


@pytest.mark.parametrize("page", ["sweeps.md", "evaluations.md"])
def test_the_page_opens_with_what_it_offers(page):
    """Its title and first paragraph: no issue number, no measured figure, no status report."""
    text = (ROOT / "docs" / page).read_text()
    title, rest = text.split("\n", 1)
    opening = rest.strip().split("\n\n", 1)[0]
    assert "issue" not in (title + opening).lower() and not measured_figures(opening)
    assert "status" not in opening.lower()


def test_the_service_quotes_no_measured_milliseconds():
    """Comments and docstrings of app/ name no milliseconds but a setting's own value."""
    settings = {("app/ledger/writer.py", "20 ms")}  # LINGER_S, the writer's wait
    found = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type in (tokenize.COMMENT, tokenize.STRING):
                for match in re.finditer(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:ms|µs)\b", token.string):
                    if (name, match.group(0)) not in settings:
                        found.append(f"{name}:{token.start[0]}: {match.group(0)}")
    assert not found, f"measured figures in the code (say docs/performance.md instead): {found}"
