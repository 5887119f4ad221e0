"""`fs-plugins launch`: FederatedScope's distributed mode (gRPC), one process per party.

Local: `fs-plugins launch --cfg X.yaml [--client_cfg C.yaml]` starts one server and one
process per client of the split on 127.0.0.1 (free ports), the server first and the clients
once it listens (FS clients do not retry joining). Each party runs `fs-plugins run --runner fs` on a
YAML derived from X (written to `<results dir>/launch/<party>.yaml`: the party's role, data
index and addresses, client k's `--client_cfg` entry merged in) and logs to
`<results dir>/launch/<party>.log`. All parties share the results directory: the server
writes results.jsonl and the global state, each client its own model, predictions and
checkpoint files. A combined progress line is printed; when one process fails, or on Ctrl-C,
every process started is stopped.

One party (multi-host): `fs-plugins launch --role server|client --data_idx K --server_host H
...` derives that party's YAML the same way and runs it in the foreground.

`--secure token|certificate` adds TLS and client authentication (fs_plugins.fs.secure) with
the credentials of a folder made by `fs-plugins credentials` (`--credentials DIR`). A local
federation launched from the command line is secured with tokens unless `--secure none` (its
loopback ports are open to every process of the machine); without `--credentials` it makes its
own in a private temporary folder outside the results directory, without keeping the CA key,
and removes them when the launcher exits.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from fs_plugins.commands.credentials import make_credentials, party_distribute
from fs_plugins.core.errors import ConfigError
from fs_plugins.fs.ports import free_ports
from fs_plugins.run.config import load_config, merge, parse_opts, read_yaml
from fs_plugins.run.runtime import build_federated_records, results_dir
from fs_plugins.schema.plugin import reads_data_type

LAUNCH_DIR = 'launch'
ROUND_LINE = re.compile(r'training (?:round )?\(Round #(\d+)\)')   # FS's server log, 0-based
POLL_S = 0.3


@dataclass
class Address:
    host: str
    port: int


def party_name(role: str, data_idx: int) -> str:
    return 'server' if role == 'server' else f'client_{data_idx}'


@dataclass
class Security:
    auth: str      # 'token' or 'certificate'
    folder: str    # made by fs_plugins.commands.credentials.make_credentials

    def layer(self, name: str) -> dict:
        return {'fsplug': {'distribute': party_distribute(self.folder, name, self.auth)}}


@dataclass
class Party:
    role: str
    data_idx: int
    address: Address
    process: subprocess.Popen | None = None
    cfg_path: str = ''
    log_path: str = ''

    @property
    def name(self) -> str:
        return party_name(self.role, self.data_idx)


def party_config(base: dict, party: Party, server: Address, run_dir: str,
                 client_entry: dict | None = None, security: Security | None = None) -> dict:
    """The YAML of one party: `base` with its role, data index and addresses (and
    credentials); a client's own `--client_cfg` entry merged in."""
    layer = {'federate': {'mode': 'distributed'},
             'distribute': {'use': True, 'role': party.role, 'data_idx': int(party.data_idx),
                            'server_host': server.host, 'server_port': int(server.port),
                            'client_host': party.address.host,
                            'client_port': int(party.address.port)},
             'fsplug': {'results_dir': run_dir},
             'outdir': os.path.join(run_dir, LAUNCH_DIR, 'fs_' + party.name)}
    if security:
        layer = merge(layer, security.layer(party.name))
    return merge(merge(base, client_entry or {}), layer)


def write_party_config(party: Party, base: dict, server: Address, run_dir: str,
                       client_cfgs: dict, security: Security | None = None) -> None:
    """Writes `party`'s derived YAML into <run_dir>/launch/ and sets its config and log paths."""
    folder = os.path.join(run_dir, LAUNCH_DIR)
    entry = client_cfgs.get(party.name) if party.role == 'client' else None
    derived = party_config(base, party, server, run_dir, entry, security)
    party.cfg_path = write_yaml(os.path.join(folder, party.name + '.yaml'), derived)
    party.log_path = os.path.join(folder, party.name + '.log')


def load_run(cfg_path: str, opts: list[str], run_dir: str | None = None):
    """(the YAML with the overrides, as a plain dict; the checked config; the results
    directory): every problem is named before a process starts."""
    cfg = load_config(cfg_path, list(opts))
    base = merge(read_yaml(cfg_path), parse_opts(list(opts)))
    return base, cfg, os.path.abspath(run_dir or results_dir(cfg))


def client_count(cfg) -> int:
    """The clients a run has: the split's (e.g. one per source with `by_source`) for the
    plugin's data, else federate.client_num."""
    if reads_data_type(cfg):
        return int(build_federated_records(cfg).client_num)
    return int(cfg.federate.client_num)


def is_listening(address: Address) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((address.host, address.port)) == 0


def write_yaml(path: str, cfg: dict) -> str:
    import yaml
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as handle:
        yaml.safe_dump(cfg, handle, sort_keys=False)
    return path


def party_command(cfg_path: str, switches: list[str], client_cfg: str | None = None) -> list[str]:
    """client_cfg: the server's: every client's entry, so that it knows what each client's
    model is and may send (a client's first update no longer tells it)."""
    clients = ['--client_cfg', os.path.abspath(client_cfg)] if client_cfg else []
    return [sys.executable, '-m', 'fs_plugins.commands.cli', 'run', '--runner', 'fs', '--cfg', cfg_path,
            *clients, *switches]


class LocalFederation:
    """One server and every client of a config as local processes."""

    def __init__(self, cfg_path: str, client_cfg: str | None = None, opts: list[str] = (),
                 switches: list[str] = (), host: str = '127.0.0.1', env: dict | None = None,
                 run_dir: str | None = None, out=None, secure: str | None = None,
                 credentials: str | None = None):
        base, cfg, self.run_dir = load_run(cfg_path, opts, run_dir)
        self.total_rounds = int(cfg.federate.total_round_num)
        self.switches, self.env, self.out = list(switches), env, out or sys.stdout
        self.client_cfg = client_cfg
        client_cfgs = read_yaml(client_cfg) if client_cfg else {}
        client_ids = range(1, client_count(cfg) + 1)
        unknown = sorted(set(client_cfgs) - {f'client_{k}' for k in client_ids})
        if unknown:
            raise ConfigError([f'{client_cfg}: {name} is not a client of this run (1 .. '
                               f'{len(client_ids)})' for name in unknown])
        server_port, *client_ports = free_ports(1 + len(client_ids), host)
        server = Address(host, server_port)
        self.parties = [Party('server', 0, server)]
        self.parties += [Party('client', k, Address(host, port))
                         for k, port in zip(client_ids, client_ports)]
        self.security = None
        if secure:
            self.security = Security(secure,
                                     credentials or self._make_credentials(client_ids, host))
        for party in self.parties:
            write_party_config(party, base, server, self.run_dir, client_cfgs, self.security)

    def _make_credentials(self, client_ids, host: str) -> str:
        return local_credentials(client_ids, sorted({host, '127.0.0.1'}))

    # -------------------------------------------------------------- processes
    def start(self, party: Party, switches: list[str] | None = None,
              command: list[str] | None = None) -> None:
        """Starts `party` (again: e.g. with `--resume DIR` after it was stopped)."""
        command = command or party_command(party.cfg_path, self.switches if switches is None
                                           else switches,
                                           self.client_cfg if party.role == 'server' else None)
        with open(party.log_path, 'a', encoding='utf-8') as log:
            party.process = subprocess.Popen(command,
                                             stdout=log, stderr=subprocess.STDOUT,
                                             env=self._party_env(), start_new_session=True)

    def _party_env(self) -> dict:
        """The parties share this machine's cores: unless OMP_NUM_THREADS says otherwise,
        each client's torch gets its share (torch's default, every core in every process,
        oversubscribes them)."""
        env = dict(os.environ if self.env is None else self.env)
        clients = len(self.parties) - 1
        env.setdefault('OMP_NUM_THREADS', str(max(1, (os.cpu_count() or 1) // max(1, clients))))
        return env

    def stop(self, party: Party, timeout: float = 10.0) -> None:
        process = party.process
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def stop_all(self) -> None:
        for party in self.parties:
            self.stop(party)

    def wait_listening(self, party: Party, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not is_listening(party.address):
            if party.process.poll() is not None:
                raise LaunchError(party, f'exited ({party.process.returncode}) before listening')
            if time.monotonic() > deadline:
                raise LaunchError(party, f'did not listen on {party.address.host}:'
                                         f'{party.address.port} within {timeout:.0f} s')
            time.sleep(POLL_S)

    # -------------------------------------------------------------- run
    def run(self, timeout: float | None = None, listen_timeout: float = 300.0) -> int:
        """Starts every party, follows them to the end; 0 when all exited cleanly."""
        print(f'fs-plugins launch: {len(self.parties) - 1} clients and a server on '
              f'{self.parties[0].address.host}; logs in {os.path.join(self.run_dir, LAUNCH_DIR)}',
              file=self.out, flush=True)
        if self.security is None:
            print('fs-plugins launch: warning: no TLS and no client authentication: any process '
                  'of this machine can join the federation or read its messages '
                  '(--secure token secures it)', file=self.out, flush=True)
        try:
            self.start(self.parties[0])
            self.wait_listening(self.parties[0], listen_timeout)
            for party in self.parties[1:]:
                self.start(party)
            self.follow(timeout)
        except LaunchError as exc:
            self.stop_all()
            print(f'fs-plugins launch: {exc}\n{exc.log_tail()}', file=self.out, flush=True)
            return 1
        except KeyboardInterrupt:
            self.stop_all()
            print('fs-plugins launch: interrupted; every process stopped', file=self.out)
            return 130
        print(f'fs-plugins launch: done; results in {self.run_dir}', file=self.out, flush=True)
        return 0

    def follow(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        shown = ''
        while True:
            for party in self.parties:
                code = party.process.poll() if party.process else None
                if code not in (None, 0):
                    raise LaunchError(party, f'exited with code {code}')
            running = [p for p in self.parties if p.process and p.process.poll() is None]
            line = self.progress(running)
            if line != shown:
                print(line, file=self.out, flush=True)
                shown = line
            if not running:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(running[0], f'still running after {timeout:.0f} s')
            time.sleep(POLL_S)

    def progress(self, running: list[Party]) -> str:
        rounds = ROUND_LINE.findall(_read(self.parties[0].log_path))
        current = int(rounds[-1]) + 1 if rounds else 0
        clients = sum(p.role == 'client' for p in running)
        server = 'running' if self.parties[0] in running else 'done'
        return (f'fs-plugins launch: round {current}/{self.total_rounds} | server {server} | '
                f'{clients}/{len(self.parties) - 1} clients running')


def local_credentials(client_ids, hosts) -> str:
    """Credentials for one local launch, in a fresh owner-only temporary folder outside the
    results directory (which may be shared): no CA key is kept, so no other certificate can
    be issued, and the folder goes when this process exits (a resumed launch makes new ones:
    fsplug.distribute may differ on resume)."""
    folder = tempfile.mkdtemp(prefix='fs-plugins-credentials-')
    atexit.register(shutil.rmtree, folder, True)
    return make_credentials(folder, client_ids, hosts=hosts, keep_ca_key=False)


class LaunchError(RuntimeError):
    def __init__(self, party: Party, what: str):
        super().__init__(f'{party.name} {what} (log: {party.log_path})')
        self.party = party

    def log_tail(self, lines: int = 30) -> str:
        return '\n'.join(_read(self.party.log_path).splitlines()[-lines:])


def _read(path: str) -> str:
    try:
        with open(path, encoding='utf-8', errors='replace') as handle:
            return handle.read()
    except FileNotFoundError:
        return ''


def launch_one(cfg_path: str, role: str, data_idx: int, server: Address, own: Address,
               client_cfg: str | None, opts: list[str], switches: list[str],
               security: Security | None = None) -> int:
    """One party of a multi-host federation, in the foreground."""
    base, _, run_dir = load_run(cfg_path, opts)
    party = Party(role, data_idx, own)
    write_party_config(party, base, server, run_dir, read_yaml(client_cfg) if client_cfg else {},
                       security)
    return subprocess.call(party_command(party.cfg_path, switches,
                                         client_cfg if role == 'server' else None))


# ------------------------------------------------------------------ shipped configs
SHIPPED_SERVER = Address('127.0.0.1', 50051)   # client k listens on 50051 + k


def shipped_party_configs(source: str, count=client_count) -> dict[str, dict]:
    """Every party's YAML of a distributed federation on fixed local ports, derived from the
    YAML `source` (and its `<name>_clients.yaml` beside it, when there is one), results in
    exp/distributed/<method>_<name>: what yamls/<method>/distributed/<name>/ ships. `count(cfg)`
    gives the number of clients (default: from the built split)."""
    stem = os.path.splitext(os.path.basename(source))[0]
    clients_path = os.path.join(os.path.dirname(source), stem + '_clients.yaml')
    client_cfgs = read_yaml(clients_path) if os.path.isfile(clients_path) else {}
    base, cfg, _ = load_run(source, [])
    run_dir = os.path.join('exp', 'distributed', f'{cfg.fsplug.method}_{stem}')
    parties = [Party('server', 0, SHIPPED_SERVER)] + [
        Party('client', k, Address(SHIPPED_SERVER.host, SHIPPED_SERVER.port + k))
        for k in range(1, count(cfg) + 1)]
    return {party.name: party_config(base, party, SHIPPED_SERVER, run_dir,
                                     client_cfgs.get(party.name) if party.role == 'client'
                                     else None)
            for party in parties}
