"""Import hook installed at interpreter start by `fs_plugins_autoload.pth`.

It waits, at no cost, until FederatedScope is imported, then:
- after `federatedscope.core.configs.config` has executed, registers the plugins
  (`fs_plugins.fs.register.register_all`), so plain `python federatedscope/main.py --cfg x.yaml`
  finds them with nothing added to the FS tree;
- serves `federatedscope.core.proto.gRPC_comm_manager_pb2` from a copy regenerated from the
  installed FS's own .proto (FS's shipped module fails with protobuf >= 4).
Set FSPLUG_NO_AUTOLOAD=1 to turn both off. Imports only the standard library.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

CONFIG_MODULE = 'federatedscope.core.configs.config'
PB2_MODULE = 'federatedscope.core.proto.gRPC_comm_manager_pb2'
DISABLE_ENV = 'FSPLUG_NO_AUTOLOAD'


class _RunAfterExec(importlib.abc.Loader):
    """Wraps a loader so that `callback(module)` runs once the module body has executed."""

    def __init__(self, loader, callback):
        self.loader, self.callback = loader, callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.callback(module)


def _register_plugins(config_module):
    from fs_plugins.fs.register import register_all
    register_all(config_module)


class PluginFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == CONFIG_MODULE:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _RunAfterExec(spec.loader, _register_plugins)
            return spec
        if fullname == PB2_MODULE and path:
            from fs_plugins.fs.proto import regenerated_pb2
            generated = regenerated_pb2(path)
            if generated:
                return importlib.util.spec_from_file_location(fullname, generated)
        return None


def install(force: bool = False) -> None:
    if not force and os.environ.get(DISABLE_ENV, '').lower() in ('1', 'true', 'yes'):
        return
    if not any(isinstance(f, PluginFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, PluginFinder())


install()
