"""What a user sees when FS's shipped gRPC module fails with protobuf's bare error
("Descriptors cannot be created directly"): the autoload hook's explanation of what to do
(fs_plugins.fs.autoload), with FSPLUG_NO_AUTOLOAD set and when no copy can be regenerated.

The loader tests need nothing; the subprocess tests run FederatedScope's own imports with the
interpreter running the tests (e.g. /opt/fsvenv/bin/python) and are skipped, with the reason,
where FS is not installed or its shipped module imports (protobuf < 4)."""
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig

import pytest

from fs_plugins.fs import autoload

FS_MISSING = importlib.util.find_spec('federatedscope') is None


def _protobuf_major() -> int:
    try:
        from google import protobuf
    except ImportError:
        return 0
    return int(protobuf.__version__.split('.')[0])


needs_fs_on_modern_protobuf = pytest.mark.skipif(
    FS_MISSING or _protobuf_major() < 4,
    reason='needs FederatedScope installed with protobuf >= 4 (where its shipped gRPC module fails)')
AUTOLOAD_PTH_INSTALLED = os.path.isfile(
    os.path.join(sysconfig.get_paths()['purelib'], 'fs_plugins_autoload.pth'))


# ------------------------------------------------------------------ the loader, without FS
BARE_ERROR = ('Descriptors cannot be created directly.\nIf this call came from a _pb2.py file, '
              'your generated code is out of date and must be regenerated with protoc >= 3.19.0.')


def _fake_fs_proto_package(tmp_path, body: str) -> str:
    """A folder holding a stand-in for FS's shipped gRPC module with `body`."""
    folder = tmp_path / 'proto'
    folder.mkdir()
    (folder / 'gRPC_comm_manager_pb2.py').write_text(body)
    return str(folder)


def _load(spec):
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize('patches, why', [(False, 'disabled'), (True, 'not_regenerated')])
def test_the_bare_protobuf_error_is_explained(tmp_path, monkeypatch, patches, why):
    folder = _fake_fs_proto_package(tmp_path, f'raise TypeError({BARE_ERROR!r})\n')
    monkeypatch.setattr('fs_plugins.fs.proto.regenerated_pb2', lambda paths: None)
    spec = autoload.PluginFinder(patches).find_spec(autoload.PB2_MODULE, [folder])
    with pytest.raises(TypeError) as raised:
        _load(spec)
    assert str(raised.value) == autoload.protobuf_advice(why)
    assert autoload.DESCRIPTOR_ERROR in str(raised.value.__cause__)   # the original, chained
    if why == 'disabled':
        assert 'unset FSPLUG_NO_AUTOLOAD' in str(raised.value)
        assert 'autoload.install(force=True)' in str(raised.value)
    else:
        assert 'grpcio-tools' in str(raised.value)
    assert 'PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python' in str(raised.value)


def test_other_errors_and_working_modules_pass_through(tmp_path):
    finder = autoload.PluginFinder(patches=False)
    folder = _fake_fs_proto_package(tmp_path, 'raise TypeError("something else")\n')
    with pytest.raises(TypeError, match='^something else$'):
        _load(finder.find_spec(autoload.PB2_MODULE, [folder]))
    (tmp_path / 'proto' / 'gRPC_comm_manager_pb2.py').write_text('VALUE = 1\n')
    spec = finder.find_spec(autoload.PB2_MODULE, [folder])
    assert _load(spec).VALUE == 1
    assert spec.loader.get_filename(autoload.PB2_MODULE).endswith('gRPC_comm_manager_pb2.py')


def test_without_autoload_only_the_explanation_is_installed(monkeypatch):
    monkeypatch.setattr(sys, 'meta_path', [f for f in sys.meta_path
                                           if not isinstance(f, autoload.PluginFinder)])
    monkeypatch.setenv(autoload.DISABLE_ENV, '1')
    autoload.install()
    finder = sys.meta_path[0]
    assert isinstance(finder, autoload.PluginFinder) and not finder.patches
    assert finder.find_spec(autoload.CONFIG_MODULE, None) is None   # no plugins registered
    autoload.install(force=True)   # what `fs-plugins run` does: the same finder now patches
    assert finder.patches and sum(isinstance(f, autoload.PluginFinder) for f in sys.meta_path) == 1


# ------------------------------------------------------------------ FS's own imports
def _python(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in (autoload.DISABLE_ENV, 'PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION')}
    clean['FSPLUG_CACHE'] = str(tmp_path / 'cache')
    return subprocess.run([sys.executable, '-c', code], env={**clean, **env}, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.fs
@needs_fs_on_modern_protobuf
@pytest.mark.skipif(not AUTOLOAD_PTH_INSTALLED,
                    reason='fs_plugins_autoload.pth is not installed for this interpreter')
def test_fs_without_autoload_says_what_to_do(tmp_path):
    """Plain `import federatedscope...` (as FS's main.py does) with FSPLUG_NO_AUTOLOAD=1."""
    proc = _python('import federatedscope.core.workers', tmp_path, FSPLUG_NO_AUTOLOAD='1')
    assert proc.returncode != 0
    explanation = proc.stderr[proc.stderr.rindex('TypeError: fs_plugins:'):]
    assert 'FSPLUG_NO_AUTOLOAD is set' in explanation, proc.stderr[-3000:]
    for advice in ('unset FSPLUG_NO_AUTOLOAD', 'fs_plugins.fs.autoload.install(force=True)',
                   'standalone runs only: set PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python'):
        assert advice in explanation
    assert autoload.DESCRIPTOR_ERROR in proc.stderr   # protobuf's own error, chained above it


@pytest.mark.fs
@needs_fs_on_modern_protobuf
def test_each_way_out_works(tmp_path):
    import_pb2 = ('import fs_plugins.fs.autoload as a;{}'
                  'import federatedscope.core.proto.gRPC_comm_manager_pb2 as m;'
                  'm.MessageRequest(); print(m.__file__)')
    pure_python = _python(import_pb2.format(''), tmp_path, FSPLUG_NO_AUTOLOAD='1',
                          PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION='python')
    assert pure_python.returncode == 0, pure_python.stderr[-3000:]
    assert not pure_python.stdout.strip().startswith(str(tmp_path / 'cache'))   # FS's own
    forced = _python(import_pb2.format('a.install(force=True);'), tmp_path, FSPLUG_NO_AUTOLOAD='1')
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert forced.stdout.strip().startswith(str(tmp_path / 'cache'))   # the regenerated copy
