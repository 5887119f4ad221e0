"""`fs-plugins run --cfg X.yaml [--client_cfg C.yaml] [--runner auto|fs|embedded] [key value ...]`
`fs-plugins methods [--import MODULE ...]` lists the registered methods.

With FederatedScope importable (and --runner auto or fs) the YAML runs through FS's own
main.py; otherwise through the embedded runner, which says so in its first log line."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import runpy
import sys

logger = logging.getLogger('fs_plugins')


def fs_available() -> bool:
    return importlib.util.find_spec('federatedscope') is not None


def run_with_fs(cfg_path: str, client_cfg: str | None, opts: list[str]) -> None:
    from fs_plugins.fs import autoload
    autoload.install(force=True)  # also when FSPLUG_NO_AUTOLOAD is set: this command asked for it
    import federatedscope
    main_py = os.path.join(os.path.dirname(federatedscope.__file__), 'main.py')
    argv = [main_py, '--cfg', cfg_path] + (['--client_cfg', client_cfg] if client_cfg else []) + opts
    print(f'fs-plugins: running through FederatedScope ({main_py})', file=sys.stderr, flush=True)
    saved, sys.argv = sys.argv, argv
    try:
        runpy.run_path(main_py, run_name='__main__')
    finally:
        sys.argv = saved


def run_embedded_cli(cfg_path: str, client_cfg: str | None, opts: list[str], reason: str) -> None:
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(name)s %(levelname)s: %(message)s')
    logger.info(f'fs-plugins: running with the embedded runner ({reason})')
    from fs_plugins.config import load_config, read_yaml
    from fs_plugins.sim.runner import run_embedded
    cfg = load_config(cfg_path, opts)
    run_embedded(cfg, read_yaml(client_cfg) if client_cfg else None)


def list_methods(modules: list[str]) -> int:
    from fs_plugins.config import import_extra_modules
    from fs_plugins.methods.registry import all_methods
    import_extra_modules(modules)
    print('\n'.join(sorted(all_methods())))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog='fs-plugins', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest='command', required=True)
    run = sub.add_parser('run', help='run a YAML (through FederatedScope when installed)')
    run.add_argument('--cfg', required=True, help='YAML config (FederatedScope format)')
    run.add_argument('--client_cfg', default=None, help='per-client overrides (FS format)')
    run.add_argument('--runner', choices=['auto', 'fs', 'embedded'], default='auto')
    run.add_argument('opts', nargs=argparse.REMAINDER, help='key value overrides')
    listing = sub.add_parser('methods', help='list the registered methods, one per line')
    listing.add_argument('--import', dest='modules', nargs='*', default=[],
                         help='modules to import first (as fsplug.import_modules)')
    args = parser.parse_args(argv)
    if args.command == 'methods':
        return list_methods(args.modules)

    from fs_plugins.config import ConfigError
    try:
        if args.runner == 'embedded':
            run_embedded_cli(args.cfg, args.client_cfg, args.opts, '--runner embedded')
        elif fs_available():
            run_with_fs(args.cfg, args.client_cfg, args.opts)
        elif args.runner == 'fs':
            parser.error('--runner fs: FederatedScope is not importable (see README: Install)')
        else:
            run_embedded_cli(args.cfg, args.client_cfg, args.opts, 'FederatedScope not installed')
    except ConfigError as exc:
        print('fs-plugins: config error:\n' + '\n'.join(f'  {p}' for p in exc.problems),
              file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f'fs-plugins: error: {exc}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
