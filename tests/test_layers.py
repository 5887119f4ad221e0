"""The package's layers (`.importlinter`, docs/architecture.md) hold: import-linter's contracts
pass, no function-level import of the package hides a dependency, and nothing below the
methods takes the run's config."""
import ast
import pathlib
import shutil
import subprocess

import pytest
from helpers import REPO

PACKAGE = pathlib.Path(REPO) / 'fs_plugins'
# the layers that receive typed values (fs_plugins.schema.specs) or plain values, never `cfg`
BELOW_METHODS = ('tuners', 'models', 'metrics', 'data', 'aggregation', 'core')


def _functions(path):
    tree = ast.parse(path.read_text(encoding='utf-8'))
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.skipif(shutil.which('lint-imports') is None, reason='import-linter is not installed '
                    "(pip install -e '.[test]')")
def test_import_contracts_hold():
    result = subprocess.run(['lint-imports'], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_function_level_imports_of_the_package_say_why():
    """A function-level import of the package dodges nothing: it is a deliberate deferral, and
    says so with a `# lazy: <why>` comment on its line."""
    unexplained = []
    for path in sorted(PACKAGE.rglob('*.py')):
        lines = path.read_text(encoding='utf-8').split('\n')
        for function in _functions(path):
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                module = getattr(node, 'module', None) or ''
                names = [alias.name for alias in getattr(node, 'names', [])]
                internal = (isinstance(node, ast.ImportFrom) and (module.startswith('fs_plugins') or node.level)
                            or isinstance(node, ast.Import) and any(n.startswith('fs_plugins') for n in names))
                text = '\n'.join(lines[node.lineno - 1:node.end_lineno]) if internal else ''
                if internal and '# lazy:' not in text:
                    unexplained.append(f'{path.relative_to(REPO)}:{node.lineno}')
    assert not unexplained, f'function-level imports without a "# lazy: <why>" comment: {unexplained}'


def test_nothing_below_the_methods_takes_the_run_config():
    takes_cfg = []
    for layer in BELOW_METHODS:
        for path in sorted((PACKAGE / layer).rglob('*.py')):
            for function in _functions(path):
                arguments = function.args.args + function.args.kwonlyargs + function.args.posonlyargs
                if any(a.arg == 'cfg' for a in arguments):
                    takes_cfg.append(f'{path.relative_to(REPO)}:{function.lineno} {function.name}')
    assert not takes_cfg, f'functions below the methods that take the run config: {takes_cfg}'


def test_only_orchestration_and_above_import_the_config_module():
    allowed = {'run', 'sim', 'fs', 'commands'}
    importers = []
    for path in sorted(PACKAGE.rglob('*.py')):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) > 1 and parts[0] in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
            imported = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                        [f'{node.module}.{a.name}' for a in node.names] if isinstance(node, ast.ImportFrom)
                        else [])
            if any(name == 'fs_plugins.run.config' or name.startswith('fs_plugins.run.config.')
                   for name in imported):
                importers.append(f'{path.relative_to(REPO)}:{node.lineno}')
    assert not importers, f'modules below orchestration importing the config module: {importers}'
