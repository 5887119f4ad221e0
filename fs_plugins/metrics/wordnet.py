"""WordNet for nltk's METEOR without nltk's downloader.

`load_wordnet()` returns nltk's WordNet reader, found in this order:
1. a WordNet nltk already finds (`python -m nltk.downloader wordnet`, NLTK_DATA, ...);
2. <fs_plugins cache>/nltk_data/corpora/wordnet, built once from Debian's packages
   `wordnet-base` and `wordnet-sense-index` (/usr/share/wordnet, WordNet 3.0, the version
   nltk's own download holds). The files are copied, not linked (nltk 3.10 refuses symlinks
   and hard links), and the `lexnames` file nltk reads, which Debian does not ship, is written
   from the table of its manual page lexnames(5WN).
Without either, a `WordNetMissing` error says how to get one.
"""
from __future__ import annotations

import gzip
import os
import re
import shutil
from functools import lru_cache

from fs_plugins.core.cache import cache_dir, ensure_cached_dir

SYSTEM_WORDNET = '/usr/share/wordnet'
LEXNAMES_MAN_PAGE = '/usr/share/man/man5/lexnames.5WN.gz'
LEXNAMES_COUNT = 45                     # WordNet 3.0's lexicographer files 00..44
# syntactic category numbers of lexnames(5WN), from a lexicographer file's name prefix
_CATEGORIES = {'noun': 1, 'verb': 2, 'adj': 3, 'adv': 4}
_LEXNAMES_ROW = re.compile(r'^(\d\d)\t\s*([a-z]+)\.([A-Za-z]+)\s*\t')
HOW_TO_GET = ('install it with `apt-get install wordnet-base wordnet-sense-index` (copied into '
              'the fs_plugins cache on first use) or `python -m nltk.downloader wordnet`')


class WordNetMissing(LookupError):
    """No WordNet for nltk could be found or built."""


def nltk_data_dir() -> str:
    """The nltk data folder inside the fs_plugins cache (FSPLUG_CACHE)."""
    return os.path.join(cache_dir(), 'nltk_data')


def cached_wordnet_dir() -> str:
    return os.path.join(nltk_data_dir(), 'corpora', 'wordnet')


def nltk_wordnet_files() -> tuple[str, ...]:
    """Every file nltk's WordNetCorpusReader opens."""
    from nltk.corpus.reader.wordnet import WordNetCorpusReader
    return tuple(WordNetCorpusReader._FILES)


def lexnames_text(man_page: str | None = None) -> str:
    """The `lexnames` file (lines "NN<TAB>name<TAB>category") from the lexnames(5WN) manual page."""
    man_page = man_page or LEXNAMES_MAN_PAGE
    with gzip.open(man_page, 'rt', encoding='utf-8', errors='replace') as handle:
        rows = [m.groups() for m in map(_LEXNAMES_ROW.match, handle) if m]
    numbers = [int(number) for number, _, _ in rows]
    if numbers != list(range(LEXNAMES_COUNT)) or any(pos not in _CATEGORIES for _, pos, _ in rows):
        raise ValueError(f'{man_page}: expected the lexicographer files 00..{LEXNAMES_COUNT - 1} '
                         f'(noun/verb/adj/adv), read {numbers}; is it WordNet 3.0\'s lexnames(5WN)?')
    return ''.join(f'{number}\t{pos}.{name}\t{_CATEGORIES[pos]}\n' for number, pos, name in rows)


def missing_system_files(source: str | None = None, man_page: str | None = None) -> list[str]:
    """The files a WordNet folder for nltk needs that `source` (default the Debian folder) and
    the manual page lack."""
    source, man_page = source or SYSTEM_WORDNET, man_page or LEXNAMES_MAN_PAGE
    missing = [os.path.join(source, name) for name in nltk_wordnet_files()
               if name != 'lexnames' and not os.path.isfile(os.path.join(source, name))]
    return missing + ([man_page] if not os.path.isfile(man_page) else [])


def build_wordnet_dir(target: str, source: str | None = None, man_page: str | None = None) -> str:
    """Copies `source`'s (default the Debian folder's) WordNet files into `target` and writes
    `lexnames`; built in a staging folder and renamed, so concurrent processes are safe.
    Returns `target`."""
    source = source or SYSTEM_WORDNET

    def build(staging: str) -> None:
        for name in nltk_wordnet_files():
            if name != 'lexnames':
                shutil.copyfile(os.path.join(source, name), os.path.join(staging, name))
        with open(os.path.join(staging, 'lexnames'), 'w', encoding='utf-8') as handle:
            handle.write(lexnames_text(man_page))
        os.chmod(staging, 0o755)
    return ensure_cached_dir(target, build, marker='lexnames')


def _nltk_wordnet():
    """nltk's lazily loaded WordNet, loaded now (LookupError when nltk finds none)."""
    from nltk.corpus import wordnet
    wordnet.ensure_loaded()
    return wordnet


def _use_cached_dir() -> None:
    """Builds the cached WordNet folder from the Debian packages if needed and puts its nltk_data
    on nltk's search path."""
    import nltk
    if not os.path.isfile(os.path.join(cached_wordnet_dir(), 'lexnames')):
        missing = missing_system_files()
        if missing:
            raise WordNetMissing(f'METEOR needs WordNet: nltk finds none (searched {nltk.data.path}) '
                                 f'and the Debian copy lacks {missing}; {HOW_TO_GET}')
        build_wordnet_dir(cached_wordnet_dir())
    if nltk_data_dir() not in nltk.data.path:
        nltk.data.path.append(nltk_data_dir())


@lru_cache(maxsize=1)
def load_wordnet():
    """nltk's WordNet reader, loaded (see the module docstring for where it comes from)."""
    try:
        import nltk  # noqa: F401
    except ImportError as err:
        raise ImportError('METEOR needs nltk: pip install -c constraints.txt nltk') from err
    try:
        return _nltk_wordnet()
    except LookupError:
        pass
    _use_cached_dir()
    try:
        return _nltk_wordnet()
    except LookupError as err:
        raise WordNetMissing(f'METEOR needs WordNet: nltk could not load {cached_wordnet_dir()} '
                             f'({err}); delete that folder to rebuild it, or {HOW_TO_GET}') from err
