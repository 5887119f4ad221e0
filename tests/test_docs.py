"""The README is the front door and docs/ is behind it: every relative link in README.md and
docs/*.md (`[text](path)`, `![alt](path)`, with an optional `#anchor`) resolves to a file of the
repository, an anchor to a heading of its target (GitHub's slugs), every docs page is linked
from the README, and the README stays short."""
import glob
import os
import re
import unicodedata

import pytest
from helpers import REPO

README = os.path.join(REPO, 'README.md')
PAGES = sorted(glob.glob(os.path.join(REPO, 'docs', '*.md')))
MAX_README_LINES = 250

FENCE = re.compile(r'^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$', re.M | re.S)
INLINE_CODE = re.compile(r'(`+)(?:(?!\1).)+?\1', re.S)
LINK = re.compile(r'!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')
HEADING = re.compile(r'^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$', re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are not links)."""
    return INLINE_CODE.sub('', FENCE.sub('', text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, with everything but letters,
    marks, digits, connector punctuation, spaces and hyphens removed, spaces turned to hyphens."""
    text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading)   # links keep their text
    parts = re.split(r'(`+[^`]*`+)', text)                        # code spans render literally
    text = ''.join(part.strip('`') if part.startswith('`') else re.sub(r'<[^>]+>', '', part)
                   for part in parts).lower()
    kept = ''.join(ch for ch in text if ch in ' -' or unicodedata.category(ch)[0] in 'LM'
                   or unicodedata.category(ch) in ('Nd', 'Nl', 'Pc'))
    return kept.replace(' ', '-')


def anchors(path: str) -> set[str]:
    """The anchors of a markdown file's headings (repeated headings get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    with open(path, encoding='utf-8') as handle:
        text = handle.read()
    for match in HEADING.finditer(FENCE.sub('', text)):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f'{base}-{count}')
    return out


def links(path: str) -> list[str]:
    return LINK.findall(prose(open(path, encoding='utf-8').read()))


def is_external(target: str) -> bool:
    return bool(re.match(r'^[a-z][a-z0-9+.-]*:', target, re.I))


def problems_of(path: str) -> list[str]:
    problems = []
    for target in links(path):
        if is_external(target):
            continue
        file_part, _, anchor = target.partition('#')
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        where = os.path.relpath(path, REPO)
        if not os.path.exists(resolved):
            problems.append(f'{where}: {target} -> no such file')
        elif anchor and resolved.endswith('.md') and anchor not in anchors(resolved):
            problems.append(f'{where}: {target} -> no heading with the anchor #{anchor}')
    return problems


@pytest.mark.parametrize('path', [README] + PAGES, ids=lambda p: os.path.relpath(p, REPO))
def test_every_relative_link_resolves(path):
    assert links(path) or path != README
    assert problems_of(path) == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(os.path.join(REPO, t.partition('#')[0])) for t in links(README)
              if not is_external(t)}
    assert [os.path.relpath(p, REPO) for p in PAGES if p not in linked] == []


def test_readme_is_a_front_door():
    with open(README, encoding='utf-8') as handle:
        lines = handle.read().splitlines()
    assert len(lines) <= MAX_README_LINES, f'README.md has {len(lines)} lines (at most {MAX_README_LINES})'


@pytest.mark.parametrize('heading, anchor', [
    ('Methods (`fsplug.method`)', 'methods-fsplugmethod'),
    ("The papers' 7B settings", 'the-papers-7b-settings'),
    ('UniFLoW: encoders + LLM', 'uniflow-encoders--llm'),
    ('FedA²-LoRA', 'feda-lora'),
    ('Tikhonov λ against FedAvg', 'tikhonov-λ-against-fedavg'),
    ('`fed_a2`', 'fed_a2'),
    ('Method keys (`fsplug.<method>.*`)', 'method-keys-fsplugmethod'),
])
def test_slug_follows_github(heading, anchor):
    assert slug(heading) == anchor


def test_checker_catches_a_broken_link_and_anchor(tmp_path):
    page = tmp_path / 'page.md'
    (tmp_path / 'other.md').write_text('# Other\n\n## A section\n', encoding='utf-8')
    page.write_text('[ok](other.md#a-section) [gone](missing.md) [bad](other.md#nope) '
                    '`[code](missing.md)`\n\n```\n[fenced](missing.md)\n```\n', encoding='utf-8')
    assert [p.split(': ', 1)[1] for p in problems_of(str(page))] == [
        'missing.md -> no such file', 'other.md#nope -> no heading with the anchor #nope']


def adding_a_method_section_6() -> str:
    with open(os.path.join(REPO, 'docs', 'adding_a_method.md'), encoding='utf-8') as handle:
        text = handle.read()
    start = text.index('## 6.')
    end = text.find('\n## ', start + 1)
    return text[start:end if end > 0 else len(text)]


def test_adding_a_method_runs_exactly_the_suites_it_lists():
    """§6 of the adding-a-method guide: the suites of its table are those its commands run
    (besides the method's own tests/test_<name>.py), and each exists."""
    section = adding_a_method_section_6()
    listed = set(re.findall(r'^\| `(tests/test_\w+\.py)` \|', section, re.MULTILINE))
    commands = '\n'.join(block for block in re.findall(r'```bash\n(.*?)```', section, re.DOTALL)
                         if 'pytest' in block)
    run = set(re.findall(r'tests/test_\w+\.py', commands)) - {'tests/test_<name>.py'}
    assert listed and listed == run, (sorted(listed - run), sorted(run - listed))
    assert all(os.path.isfile(os.path.join(REPO, path)) for path in listed)
