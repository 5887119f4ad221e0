"""`fs-plugins run --cfg X.yaml [--client_cfg C.yaml] [--runner auto|fs|embedded] [key value ...]`
`fs-plugins methods [--import MODULE ...]` lists the registered methods.
`fs-plugins estimate --cfg X.yaml [--client_cfg C.yaml] [--seq-len N] [key value ...]` sizes each
client's training (parameters, peak memory with and without gradient checkpointing, bytes per
round) without reading any pretrained weight (see fs_plugins.commands.estimate).
`fs-plugins audit --cfg X.yaml [--client_cfg C.yaml] [--tiny] [key value ...]` runs two clients
for a few local steps and prints what trains and what travels, checked against the method's
contract (see fs_plugins.run.audit).
`fs-plugins predict --run DIR [--client K] --input Q.jsonl [--output A.jsonl]` answers questions
with a run's fine-tuned model; `fs-plugins eval --run DIR [--client K] --data FILE` re-evaluates
it on another dataset; `fs-plugins export --run DIR [--client K] [--merge] --out DIR2` writes it
as a Hugging Face folder (see fs_plugins.run.trained). A run folder may come from anyone: the
modules its saved config names (fsplug.import_modules) are imported only when given again as
`--import-module M`, and the working directory is not searched for modules.
`fs-plugins launch --cfg X.yaml [--client_cfg C.yaml]` runs FederatedScope's distributed mode
as local processes, with TLS and token authentication unless `--secure none`;
`--role server|client --data_idx K --server_host H` starts one party of a multi-host federation
(see fs_plugins.commands.launch); `--secure token|certificate` adds TLS and client
authentication there. `fs-plugins credentials --out DIR --clients N [--hosts H1,H2]` makes the
CA, certificates, keys and client tokens for it (see fs_plugins.commands.credentials).
`fs-plugins reproduce PAPER TABLE [--rows ...] [--seeds ...] [--dry-run] [--scale tiny|paper]`
runs a paper's results table and prints it beside the paper's numbers (see
fs_plugins.commands.reproduce, docs/reproduce.md).

With FederatedScope importable (and --runner auto or fs) the YAML runs through FS's own
main.py; otherwise through the embedded runner, which says so in its first log line.

Every command that reads a YAML checks it before importing torch / transformers
(`fs_plugins.schema.precheck`), so a mistake in it ends in about a second; what only the filled
registries can tell is checked after the imports."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import runpy
import sys

from fs_plugins.commands import reproduce as reproducing
from fs_plugins.commands.credentials import CredentialsError, make_credentials, party_files
from fs_plugins.core.errors import ConfigError
from fs_plugins.schema.loading import read_yaml
from fs_plugins.schema.placeholders import placeholder_problems
from fs_plugins.schema.precheck import precheck

logger = logging.getLogger('fs_plugins')


def fs_available() -> bool:
    return importlib.util.find_spec('federatedscope') is not None


def run_with_fs(cfg_path: str, client_cfg: str | None, opts: list[str]) -> None:
    from fs_plugins.fs import autoload  # lazy: the FS binding, only for runs through FederatedScope
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


def check_before_imports(cfg_path: str, opts: list[str], client_cfg: str | None = None,
                         fs: bool = False, placeholders: bool = True) -> None:
    """Raises the ConfigError that loading the config would raise later, for every problem that
    can be found without importing torch (all but the choices a registry owns and the methods'
    rules between keys). fs: the YAML goes to FederatedScope, which reads --client_cfg itself
    (only its placeholders are checked here). placeholders: refuse `/path/to/` values left in
    the YAML, the command line or the --client_cfg file."""
    entries = read_yaml(client_cfg) if client_cfg and (not fs or os.path.isfile(client_cfg)) else {}
    in_client_cfg = placeholder_problems([(entries, client_cfg)], overridable=False) \
        if placeholders and entries else []
    try:
        precheck(cfg_path, opts, fs=fs, placeholders=placeholders)
    except ConfigError as exc:
        raise ConfigError(exc.problems + in_client_cfg) from None
    if in_client_cfg:
        raise ConfigError(in_client_cfg)


def run_embedded_cli(cfg_path: str, client_cfg: str | None, opts: list[str], reason: str) -> None:
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(name)s %(levelname)s: %(message)s')
    logger.info(f'fs-plugins: running with the embedded runner ({reason})')
    from fs_plugins.run.config import load_config  # lazy: imports torch, after the pre-check
    from fs_plugins.sim.runner import run_embedded  # lazy: imports torch, after the pre-check
    cfg = load_config(cfg_path, opts)
    run_embedded(cfg, read_yaml(client_cfg) if client_cfg else None)


def list_methods(modules: list[str]) -> int:
    from fs_plugins.methods.registry import all_methods  # lazy: imports torch (the methods)
    from fs_plugins.run.config import import_extra_modules  # lazy: imports torch
    import_extra_modules(modules)
    print('\n'.join(sorted(all_methods())))
    return 0


def after_precheck(args, body, placeholders: bool = True) -> int:
    """`body()` (it imports torch) after the YAML's pre-check; a config error, a missing file or
    a bad value ends in one message and exit code 2. placeholders: refuse `/path/to/` values
    (not under --tiny, which drops them, nor for a command that reads no data)."""
    try:
        check_before_imports(args.cfg, args.opts, args.client_cfg,
                             placeholders=placeholders and not getattr(args, 'tiny', False))
    except ConfigError as exc:
        return _config_error(exc)
    logging.basicConfig(level=logging.WARNING)
    try:
        return body()
    except ConfigError as exc:
        return _config_error(exc)
    except (FileNotFoundError, ValueError) as exc:
        print(f'fs-plugins: error: {exc}', file=sys.stderr)
        return 2


def estimate(args) -> int:
    def body() -> int:
        from fs_plugins.commands.estimate import estimate_run, format_table  # lazy: imports torch, after the pre-check
        from fs_plugins.run.config import load_config  # lazy: imports torch, after the pre-check
        cfg = load_config(args.cfg, args.opts)
        estimates = estimate_run(cfg, read_yaml(args.client_cfg) if args.client_cfg else None,
                                 args.seq_len, activations=not args.no_activations)
        print(f'Estimate for {args.cfg} ({cfg.fsplug.method}, {cfg.fsplug.model.dtype} base, '
              f'quantization {cfg.fsplug.model.quantization}, {cfg.train.optimizer.type}):')
        print(format_table(estimates))
        return 0
    # the estimate reads no data: a data path left as a placeholder does not stop it (a model
    # placeholder fails where the architecture is read, naming the path)
    return after_precheck(args, body, placeholders=False)


def audit(args) -> int:
    def body() -> int:
        from fs_plugins.commands.audit import run_audit  # lazy: imports torch, after the pre-check
        return run_audit(args)
    return after_precheck(args, body)


def _config_error(exc) -> int:
    """A ConfigError (a DataFileError among them), printed without a traceback."""
    print(exc.report(), file=sys.stderr)
    return 2


def _write_jsonl(rows, path: str | None) -> None:
    import json
    lines = ''.join(json.dumps(row, ensure_ascii=False) + '\n' for row in rows)
    if path is None:
        sys.stdout.write(lines)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as handle:
        handle.write(lines)
    print(f'fs-plugins: {len(rows)} answer(s) -> {path}', file=sys.stderr)


PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drop_working_dir_from_path() -> None:
    """`python -m fs_plugins ...` puts the working directory first on sys.path: in a run folder
    from elsewhere, a module there (even one named like a library imported later, peft.py)
    would run. Commands that read such folders take it off; --import-module modules must then
    be installed or on PYTHONPATH."""
    started_as_module = os.path.abspath(sys.argv[0]).startswith(PACKAGE_DIR + os.sep)
    if started_as_module and sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.getcwd():
        del sys.path[0]


def use_trained(args) -> int:
    """predict / eval / export on a run's saved model; bad input ends in one line naming it."""
    drop_working_dir_from_path()
    import json

    from fs_plugins.run import trained  # lazy: imports torch
    from fs_plugins.run.artifacts import ArtifactError  # lazy: imports torch
    logging.basicConfig(level=logging.WARNING)
    modules = tuple(args.import_modules)
    try:
        if args.command == 'predict':
            _write_jsonl(trained.predict(args.run, args.input, args.client, args.batch_size,
                                         args.max_new_tokens, args.device, modules), args.output)
        elif args.command == 'eval':
            metrics = trained.evaluate(args.run, args.data, args.client, args.batch_size,
                                       args.device, modules)
            print(json.dumps(metrics, indent=2))
            if args.output:
                with open(args.output, 'w', encoding='utf-8') as handle:
                    json.dump(metrics, handle, indent=2)
        else:
            out = args.out or os.path.join(args.run, 'export', 'global' if args.client is None
                                           else f'client_{args.client}') + ('_merged' if args.merge else '')
            exported = trained.export(args.run, out, args.client, args.merge, modules)
            print(f'fs-plugins: exported -> {exported}')
    except ConfigError as exc:
        return _config_error(exc)
    except (ArtifactError, FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f'fs-plugins: error: {exc}', file=sys.stderr)
        return 2
    return 0


def _trained_parser(sub, name: str, help: str):
    parser = sub.add_parser(name, help=help)
    parser.add_argument('--run', required=True, help="a run's results directory")
    parser.add_argument('--client', type=int, default=None,
                        help="a client's personalised model (default: the global state)")
    parser.add_argument('--import-module', dest='import_modules', action='append', default=[],
                        metavar='MODULE',
                        help="import MODULE first (repeatable): the run's fsplug.import_modules "
                             "are imported only when given here, as a run folder may come from "
                             "anyone")
    if name != 'export':
        parser.add_argument('--batch-size', type=int, default=None,
                            help='default: fsplug.eval.batch_size, else dataloader.batch_size')
        parser.add_argument('--device', default=None, help='default: the run config (use_gpu)')
    return parser


def _launch_parser(sub) -> None:
    launching = sub.add_parser('launch', help='FederatedScope distributed mode: a local '
                                              'federation of processes, or one party')
    launching.add_argument('--cfg', required=True, help='YAML config (FederatedScope format)')
    launching.add_argument('--client_cfg', default=None, help='per-client overrides (FS format)')
    launching.add_argument('--role', choices=['local', 'server', 'client'], default='local',
                           help='local: a server and every client here; server/client: one '
                                'party of a multi-host federation')
    launching.add_argument('--data_idx', type=int, default=0, help='the client (with --role client)')
    launching.add_argument('--server_host', default='127.0.0.1')
    launching.add_argument('--server_port', type=int, default=50051)
    launching.add_argument('--host', default=None,
                           help="this party's address others reach it at (default: the "
                                "server's host for the server; 127.0.0.1 for a client)")
    launching.add_argument('--port', type=int, default=None,
                           help="this party's port (default: the server's port for the server, "
                                "50051 + data_idx for a client)")
    launching.add_argument('--timeout', type=float, default=None,
                           help='local: stop every process after this many seconds')
    launching.add_argument('--resume', default=None, metavar='DIR')
    launching.add_argument('--overwrite', action='store_true')
    launching.add_argument('--secure', choices=['token', 'certificate', 'none'], default=None,
                           help='TLS, and clients authenticated by token or certificate '
                                '(fsplug.distribute.auth); local default: token (none: '
                                'plaintext, any local process can join)')
    launching.add_argument('--credentials', default=None, metavar='DIR',
                           help='with --secure: a folder made by `fs-plugins credentials` '
                                '(local default: new ones in a private temporary folder, '
                                'removed when the launch ends)')
    launching.add_argument('opts', nargs=argparse.REMAINDER, help='key value overrides')


def _credentials_parser(sub) -> None:
    making = sub.add_parser('credentials', help='a CA, certificates, keys and client tokens '
                                                'for a distributed federation')
    making.add_argument('--out', required=True, help='the folder to write them to')
    making.add_argument('--clients', type=int, required=True, help='clients 1 .. N')
    making.add_argument('--hosts', default='127.0.0.1,localhost',
                        help='comma-separated addresses (IPs or DNS names) the parties reach '
                             'each other at: every certificate names them all')
    making.add_argument('--days', type=int, default=365, help='validity of the certificates')


def credentials(args) -> int:
    hosts = [h.strip() for h in args.hosts.split(',') if h.strip()]
    try:
        folder = make_credentials(args.out, range(1, args.clients + 1), hosts, args.days)
    except CredentialsError as exc:
        print(f'fs-plugins credentials: {exc}', file=sys.stderr)
        return 2
    print(f'fs-plugins credentials: written to {folder} (certificates for {", ".join(hosts)})\n'
          f'  every party: ca.pem; the server: {", ".join(party_files("server", "token")[1:])}; '
          f'client k: {", ".join(party_files("client_<k>", "token")[1:])}\n'
          f'  ca.key signs more certificates: keep it off the parties\' machines')
    return 0


def launch(args) -> int:
    if not fs_available():
        print('fs-plugins launch: FederatedScope is not importable (see README: Install)',
              file=sys.stderr)
        return 2
    switches = (['--resume', args.resume] if args.resume else []) + \
        (['--overwrite'] if args.overwrite else [])
    secure = launch_security(args.secure, args.role)
    if args.credentials and not secure:
        print('fs-plugins launch: --credentials needs --secure token|certificate', file=sys.stderr)
        return 2
    try:
        # launch loads the YAML as the embedded runner does before it writes the parties' files
        check_before_imports(args.cfg, args.opts, args.client_cfg)
    except ConfigError as exc:
        return _config_error(exc)
    from fs_plugins.commands.launch import Address, LocalFederation, Security, launch_one  # lazy: torch
    try:
        if args.role == 'local':
            federation = LocalFederation(args.cfg, args.client_cfg, args.opts, switches,
                                         run_dir=args.resume, secure=secure,
                                         credentials=args.credentials)
            return federation.run(timeout=args.timeout)
        if secure and not args.credentials:
            print('fs-plugins launch: --secure with --role server|client needs --credentials DIR '
                  '(fs-plugins credentials makes one)', file=sys.stderr)
            return 2
        security = Security(secure, args.credentials) if secure else None
        server = Address(args.server_host, args.server_port)
        if args.role == 'server':
            own = Address(args.host or args.server_host, args.port or args.server_port)
        else:
            own = Address(args.host or '127.0.0.1', args.port or args.server_port + args.data_idx)
        return launch_one(args.cfg, args.role, args.data_idx, server, own, args.client_cfg,
                          args.opts, switches, security)
    except ConfigError as exc:
        return _config_error(exc)
    except CredentialsError as exc:
        print(f'fs-plugins launch: {exc}' + (' (a local launch uses TLS and tokens unless '
                                             '--secure none)' if args.role == 'local' else ''),
              file=sys.stderr)
        return 2


def launch_security(secure: str | None, role: str) -> str | None:
    """The auth of `--secure` ('none': None); a local federation defaults to token auth, as
    any process of the machine can reach its loopback ports."""
    if secure is None:
        return 'token' if role == 'local' else None
    return None if secure == 'none' else secure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog='fs-plugins', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest='command', required=True)
    run = sub.add_parser('run', help='run a YAML (through FederatedScope when installed)')
    run.add_argument('--cfg', required=True, help='YAML config (FederatedScope format)')
    run.add_argument('--client_cfg', default=None, help='per-client overrides (FS format)')
    run.add_argument('--runner', choices=['auto', 'fs', 'embedded'], default='auto')
    run.add_argument('--resume', default=None, metavar='DIR',
                     help="continue the run whose results directory is DIR from its checkpoint "
                          "(fsplug.checkpoint.resume_from)")
    run.add_argument('--overwrite', action='store_true',
                     help="replace the results of an earlier run in the results directory "
                          "(fsplug.overwrite)")
    run.add_argument('opts', nargs=argparse.REMAINDER, help='key value overrides')
    _launch_parser(sub)
    _credentials_parser(sub)
    reproducing.add_parser(sub)
    listing = sub.add_parser('methods', help='list the registered methods, one per line')
    listing.add_argument('--import', dest='modules', nargs='*', default=[],
                         help='modules to import first (as fsplug.import_modules)')
    sizing = sub.add_parser('estimate', help='parameters, peak training memory and bytes per '
                                             'round of each client, before running')
    sizing.add_argument('--cfg', required=True, help='YAML config (FederatedScope format)')
    sizing.add_argument('--client_cfg', default=None, help='per-client overrides (FS format)')
    sizing.add_argument('--seq-len', type=int, default=None,
                        help='text tokens per sample (default: llm.tok_len, the longest)')
    sizing.add_argument('--no-activations', action='store_true',
                        help='skip the activation probe (seconds instead of minutes): parameters, '
                             'weights, optimiser state and communication only')
    sizing.add_argument('opts', nargs=argparse.REMAINDER, help='key value overrides')
    auditing = sub.add_parser('audit', help="what trains and what travels in a short round of two "
                                            "clients, checked against the method's contract")
    auditing.add_argument('--cfg', required=True, help='YAML config (FederatedScope format)')
    auditing.add_argument('--client_cfg', default=None, help='per-client overrides (FS format)')
    auditing.add_argument('--tiny', action='store_true',
                          help='audit the same method, options and LoRA targets on a random-weight '
                               'model of the same family, on offline data')
    auditing.add_argument('--clients', type=int, default=2, help='clients taking part (default 2)')
    auditing.add_argument('--steps', type=int, default=4, help='local steps per pass (default 4)')
    auditing.add_argument('--json', default=None, help='also write the report as JSON')
    auditing.add_argument('opts', nargs=argparse.REMAINDER, help='key value overrides')
    predict = _trained_parser(sub, 'predict', "answer questions with a run's fine-tuned model")
    predict.add_argument('--input', required=True,
                         help='.jsonl/.json: instruction records, or image + question records')
    predict.add_argument('--output', default=None, help='answers as JSON lines (default: stdout)')
    predict.add_argument('--max-new-tokens', type=int, default=None,
                         help='default: fsplug.eval.max_new_tokens')
    evaluation = _trained_parser(sub, 'eval', 'the run\'s metrics on another dataset')
    evaluation.add_argument('--data', required=True, help='records with answers (.jsonl/.json)')
    evaluation.add_argument('--output', default=None, help='also write the metrics as JSON')
    export = _trained_parser(sub, 'export', 'write the model as a Hugging Face folder')
    export.add_argument('--merge', action='store_true',
                        help='merge the LoRA into the base weights (a full model)')
    export.add_argument('--out', default=None,
                        help='default: RUN/export/<global|client_K>[_merged]')
    args = parser.parse_args(argv)
    if args.command == 'methods':
        return list_methods(args.modules)
    if args.command == 'estimate':
        return estimate(args)
    if args.command == 'audit':
        return audit(args)
    if args.command in ('predict', 'eval', 'export'):
        return use_trained(args)
    if args.command == 'launch':
        return launch(args)
    if args.command == 'credentials':
        return credentials(args)
    if args.command == 'reproduce':
        return reproducing.main(args)

    args.opts = run_switches(args) + list(args.opts)
    with_fs = args.runner != 'embedded' and fs_available()
    if args.runner == 'fs' and not with_fs:
        parser.error('--runner fs: FederatedScope is not importable (see README: Install)')
    try:
        check_before_imports(args.cfg, args.opts, args.client_cfg, fs=with_fs)
    except ConfigError as exc:
        return _config_error(exc)
    from fs_plugins.run.checkpoint import CheckpointError  # lazy: imports torch, after the pre-check
    try:
        if args.runner == 'embedded':
            run_embedded_cli(args.cfg, args.client_cfg, args.opts, '--runner embedded')
        elif with_fs:
            run_with_fs(args.cfg, args.client_cfg, args.opts)
        else:
            run_embedded_cli(args.cfg, args.client_cfg, args.opts, 'FederatedScope not installed')
    except ConfigError as exc:
        return _config_error(exc)
    except (FileNotFoundError, CheckpointError) as exc:
        print(f'fs-plugins: error: {exc}', file=sys.stderr)
        return 2
    return 0


def run_switches(args) -> list[str]:
    """--resume / --overwrite as the config keys they stand for."""
    opts = ['fsplug.checkpoint.resume_from', args.resume] if args.resume else []
    return opts + (['fsplug.overwrite', 'True'] if args.overwrite else [])


if __name__ == '__main__':
    sys.exit(main())
