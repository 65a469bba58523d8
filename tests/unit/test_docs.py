"""The docs against the code: every `inferno up` flag documented, every README/docs link resolving."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from unittest import mock

import pytest

from services import launcher

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def up_parser() -> argparse.ArgumentParser:
    """The parser `inferno up` builds, caught where it would parse (nothing is started)."""

    def catch(parser: argparse.ArgumentParser, *args, **kwargs):
        raise _Built(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", catch):
        with pytest.raises(_Built) as built:
            launcher.parse_args([])
    return built.value.parser


def help_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every long option string `--help` prints (suppressed options are not printed)."""
    return {s for a in parser._actions if a.help is not argparse.SUPPRESS
            for s in a.option_strings if s.startswith("--")}


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are code, not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' dropped, spaces as '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_pages_exist():
    assert (DOCS / "configuration.md").is_file()
    assert len(PAGES) > 2


def test_help_flags_sees_the_parser():
    flags = help_flags(up_parser())
    assert {"--model", "--workers", "--device", "--tensor-parallel-size", "--help"} <= flags
    assert "-tp" not in flags


def test_every_flag_of_inferno_up_is_in_the_configuration_page():
    page = (DOCS / "configuration.md").read_text()
    missing = sorted(f for f in help_flags(up_parser())
                     if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", page))
    assert missing == [], f"flags of `inferno up --help` not in docs/configuration.md: {missing}"


def test_anchors_follow_github():
    assert anchors("# A\n## `inferno up`\n## Prefill/decode disaggregation\n## A\n") == {
        "a", "inferno-up", "prefilldecode-disaggregation", "a-1"}
    assert anchors("```\n# not a heading\n```\n") == set()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_something_that_exists(page: Path):
    text = page.read_text()
    broken = []
    for target in LINK.findall(prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target} (no such heading)")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links: {broken}"
