"""docs/reference.md's method table, key reference and paper coverage are generated from the
registry, the schema and docs/paper_tables.yaml by scripts/gen_reference.py; this fails when the
page is stale (a method or key added without regenerating)."""
import os
import subprocess
import sys

from helpers import REPO


def test_reference_page_is_current():
    result = subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'gen_reference.py'), '--check'],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_reference_lists_every_registered_method():
    sys.path.insert(0, os.path.join(REPO, 'scripts'))
    import gen_reference

    from fs_plugins.methods.registry import all_methods
    text = gen_reference.render()
    for name in all_methods():
        assert f'| `{name}` |' in text
