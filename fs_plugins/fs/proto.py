"""Regenerates FS's gRPC message module from its own .proto with the installed protoc
(grpcio-tools), into a cache directory keyed by the .proto's content and protobuf's version.
Nothing generated is committed or written into the FS tree. Imported by the autoload hook
only once FS's proto package is: the standard library and `fs_plugins.core.cache` only."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from fs_plugins.core.cache import cache_dir

PROTO_NAME = 'gRPC_comm_manager.proto'


def _cache_root() -> str:
    return os.path.join(cache_dir(), 'proto')


def regenerated_pb2(package_paths) -> str | None:
    """Path of the regenerated `gRPC_comm_manager_pb2.py` for the FS proto package at
    `package_paths`; None when FS's .proto or grpc_tools is missing (FS's module is used)."""
    proto = next((os.path.join(p, PROTO_NAME) for p in package_paths
                  if os.path.isfile(os.path.join(p, PROTO_NAME))), None)
    if proto is None:
        return None
    try:
        import google.protobuf  # lazy: optional (the `fs` extra); absent: FS's module is used
        from grpc_tools import protoc  # lazy: optional (the `fs` extra); absent: FS's module is used
    except ImportError:
        return None
    with open(proto, 'rb') as handle:
        digest = hashlib.sha256(handle.read() + google.protobuf.__version__.encode()).hexdigest()[:16]
    out_dir = os.path.join(_cache_root(), digest)
    target = os.path.join(out_dir, 'gRPC_comm_manager_pb2.py')
    if os.path.isfile(target):
        return target
    os.makedirs(_cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=_cache_root(), prefix='.gen-')
    try:
        include = os.path.dirname(proto)
        code = protoc.main(['protoc', f'-I{include}', f'--python_out={tmp}', proto])
        if code != 0:
            raise RuntimeError(f'protoc failed ({code}) on {proto}')
        try:
            os.rename(tmp, out_dir)  # atomic; a concurrent process may have won
        except OSError:
            if not os.path.isfile(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
