"""The README's method table and key reference are generated from the registry and the schema;
this fails when they are stale (a method or key added without regenerating)."""
import os
import subprocess
import sys

from helpers import REPO


def test_readme_reference_is_current():
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
