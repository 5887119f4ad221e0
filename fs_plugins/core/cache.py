"""Model folders built locally once (tiny random models, converted registry checkpoints) and
kept in a cache directory: `FSPLUG_CACHE`, else ~/.cache/fs_plugins."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable


def cache_dir() -> str:
    return os.environ.get('FSPLUG_CACHE', os.path.join(os.path.expanduser('~'), '.cache', 'fs_plugins'))


def ensure_cached_dir(path: str | None, build: Callable[[str], None], name: str = '',
                      marker: str = 'config.json') -> str:
    """The folder `path` (default <cache>/<name>), built by `build(folder)` if it has no file
    `marker` yet. Built in a staging folder and renamed, so concurrent processes are safe."""
    path = path or os.path.join(cache_dir(), name)
    if os.path.isfile(os.path.join(path, marker)):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=f'.{os.path.basename(path)}-')
    try:
        build(staging)
        try:
            os.rename(staging, path)
        except OSError:  # another process won the race
            if not os.path.isfile(os.path.join(path, marker)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
