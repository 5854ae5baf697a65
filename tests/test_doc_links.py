"""Every relative link of the project's Markdown pages points at something that is there: a file or folder of the
repository, and, after `#`, a heading of that page (as GitHub makes anchors of headings). Links to the web are not
followed (no network here)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        *ROOT.glob("*.md"),
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("vllm_plugin/*.md"),
        *ROOT.glob("benchmarks/results/*.md"),
    ]
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation but '-' and '_' dropped, spaces to '-',
    a repeated heading numbered -1, -2, ... (code blocks are not headings)."""
    seen, found, in_code = {}, set(), False
    for line in page.read_text().splitlines():
        if line.strip().startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def links(page: Path) -> list[tuple[int, str]]:
    out, in_code = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            out += [(number, target) for target in LINK.findall(line.replace("`", ""))]
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for number, target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.name}:{number}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{page.name}:{number}: {target} (no heading gives #{anchor})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, "\n".join(broken)


def test_the_checker_finds_what_is_broken(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A `code` title\n## Setup\n## Setup\n```text\n# not a heading [x](missing.md)\n```\n"
        "[ok](#setup-1) ![img](pic.png) [web](https://example.com) [gone](#nothing) [other](other.md#setup)\n"
    )
    (tmp_path / "other.md").write_text("## Set up\n")
    assert anchors(page) == {"a-code-title", "setup", "setup-1"}
    assert [target for _, target in links(page)] == [
        "#setup-1",
        "pic.png",
        "https://example.com",
        "#nothing",
        "other.md#setup",
    ]
    assert broken_links(page) == [
        "page.md:7: pic.png (no such file)",
        "page.md:7: #nothing (no heading gives #nothing)",
        "page.md:7: other.md#setup (no heading gives #setup)",
    ]


def test_the_speed_page_opens_with_a_summary_and_keeps_the_runs_apart():
    """docs/speed.md's first section is one table of what is fast against what, each row naming its machine (or
    pointing at the row above's) and its date, and linking to its run in benchmarks/results/HISTORY.md, which holds
    the runs; no round of history is left on the summary page."""
    speed = (ROOT / "docs" / "speed.md").read_text()
    history = (ROOT / "benchmarks" / "results" / "HISTORY.md").read_text()
    sections = re.split(r"^## ", speed, flags=re.M)
    assert sections[1].startswith("Summary\n"), sections[1][:80]
    rows = [line for line in sections[1].splitlines() if line.startswith("| ")][2:]  # after the header and |---|
    assert len(rows) >= 10
    for row in rows:
        machine = row.strip(" |").split(" | ")[-1]
        assert re.search(r"20\d\d-\d\d-\d\d", machine) or machine.startswith("same "), row
    assert sum("HISTORY.md#" in row for row in rows) >= 8
    for run in (
        "third round, 2026-11-24",
        "second round, 2026-11-22",
        "The H200 run (2026-11-26)",
        "The first GPU run",
    ):
        assert f"## {run}" not in speed and run in history, run
