"""Time and bytes per round of one run in FS standalone and launched distributed on 127.0.0.1
(plaintext, TLS + token, TLS + client certificates), printed side by side; in the secured
runs, outsiders try to join while the server listens (plaintext, and client 1's credentials
claiming client 2) and the refusals are counted. Then one large update through each kind of
channel. Needs FederatedScope with grpcio.

python scripts/bench_distributed.py [--cfg yamls/fedavg/tiny.yaml] [--clients 3] [--rounds 5]
                                    [--message_mb 256] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

NEEDS_FEDERATEDSCOPE = True   # tests/test_bench_scripts.py skips the script without it
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tests'))
from helpers import outsiders_are_refused  # noqa: E402  (shared with the tests)

ROUND_START = re.compile(r'(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) .*'   # FS's lines may be coloured
                         r'training (?:round )?\(Round #(\d+)\)')
TRAFFIC = re.compile(r'fs-plugins: sent (\d+) messages, (\d+) bytes \(([^)]*)\); refused (\d+)')


def seconds_per_round(log: str) -> float:
    """From FS's server log: the mean time between round starts (model building excluded)."""
    starts = [datetime.datetime.strptime(stamp, '%Y-%m-%d %H:%M:%S,%f')
              for stamp, _ in ROUND_START.findall(log)]
    if len(starts) < 2:
        return float('nan')
    return (starts[-1] - starts[0]).total_seconds() / (len(starts) - 1)


def payload_bytes(run_dir: str) -> int:
    with open(os.path.join(run_dir, 'results.jsonl')) as handle:
        rows = [json.loads(line) for line in handle]
    return sum(r.get('bytes_up', 0) + r.get('bytes_down', 0) for r in rows if r['kind'] == 'train')


def run_standalone(cfg: str, opts: list[str], run_dir: str) -> dict:
    log_path = os.path.join(run_dir + '.log')
    with open(log_path, 'w') as log:
        subprocess.run([sys.executable, '-m', 'fs_plugins.commands.cli', 'run', '--runner', 'fs', '--cfg',
                        cfg, *opts, 'fsplug.results_dir', run_dir], stdout=log,
                       stderr=subprocess.STDOUT, check=True, cwd=REPO)
    with open(log_path) as handle:
        return {'log': handle.read(), 'wire': None, 'refused': None}


def run_launched(cfg: str, opts: list[str], run_dir: str, secure: str | None) -> dict:
    from fs_plugins.commands.launch import LocalFederation
    federation = LocalFederation(cfg, opts=[*opts, 'fsplug.results_dir', run_dir],
                                 secure=secure, out=io.StringIO())
    server = federation.parties[0]
    try:
        federation.start(server)
        federation.wait_listening(server, 300)
        if secure:
            outsiders_are_refused(server.address.port, federation.security)
        for party in federation.parties[1:]:
            federation.start(party)
        federation.follow(timeout=1800)
    finally:
        federation.stop_all()
    logs = {}
    for party in federation.parties:
        with open(party.log_path) as handle:
            logs[party.name] = handle.read()
    traffic = [TRAFFIC.search(text) for text in logs.values()]
    missing = [name for name, found in zip(logs, traffic) if not found]
    if missing:
        raise RuntimeError(f'no traffic line in the logs of {missing}')
    return {'log': logs['server'], 'wire': sum(int(t.group(2)) for t in traffic),
            'refused': int(TRAFFIC.search(logs['server']).group(4))}


def time_one_message(megabytes: int, secure: str | None, folder: str) -> float:
    """Seconds to deliver one update of `megabytes` MiB of float32 (encoded as the workers
    encode it) from a client to the server, each a plugin comm manager on 127.0.0.1."""
    import torch
    from federatedscope.core.message import Message

    from fs_plugins.commands.credentials import party_distribute
    from fs_plugins.fs.secure import party_comm_manager
    from fs_plugins.fs.wire import encode_update
    from fs_plugins.methods.base import ClientUpdate
    rows = megabytes * 2 ** 20 // (4 * 4096)
    update = ClientUpdate(1, 8, {'w': torch.randn(rows, 4096)}, {}, {'loss': 1.0})
    content = encode_update(update, distributed=True)
    managers = {role: party_comm_manager(role, party_distribute(folder, party, secure)
                                         if secure else None)
                for role, party in (('server', 'server'), ('client', 'client_1'))}
    try:
        managers['client'].add_neighbors(0, f"127.0.0.1:{managers['server'].port}")
        started = time.perf_counter()
        managers['client'].send(Message(msg_type='model_para', sender=1, receiver=[0], state=0,
                                        timestamp=0, content=(8, content)))
        managers['server'].receive()
        return time.perf_counter() - started
    finally:
        for manager in managers.values():
            manager.grpc_server.stop(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--cfg', default=os.path.join('yamls', 'fedavg', 'tiny.yaml'))
    parser.add_argument('--clients', type=int, default=3)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--message_mb', type=int, default=256,
                        help='then: one update of this size, plaintext vs TLS (0: skip)')
    parser.add_argument('--quick', action='store_true',
                        help='a check that the script works: 2 clients, 2 rounds, FS standalone '
                             'and TLS + token only, a 1 MiB message')
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.rounds, args.message_mb = 2, 2, 1
    os.chdir(REPO)
    opts = ['data.splitter', 'iid', 'federate.client_num', str(args.clients),
            'federate.sample_client_num', str(args.clients),
            'federate.total_round_num', str(args.rounds), 'fsplug.overwrite', 'True']
    work = tempfile.mkdtemp(prefix='bench_distributed_')
    runs = [('FS standalone', None, None), ('distributed, plaintext', 'launch', None),
            ('distributed, TLS + token', 'launch', 'token'),
            ('distributed, TLS + certificates', 'launch', 'certificate')]
    if args.quick:
        runs = [runs[0], runs[2]]
    print(f'{args.cfg}, {args.clients} clients, {args.rounds} rounds, 127.0.0.1 '
          f'({os.cpu_count()} CPU cores); results in {work}')
    print('| run | s / round | payload MiB / round | gRPC MiB / round (all parties) | '
          'wall s | outsiders refused |')
    print('|---|---|---|---|---|---|')
    for label, mode, secure in runs:
        run_dir = os.path.join(work, label.replace(' ', '_').replace(',', '').replace('+', ''))
        started = time.perf_counter()
        if mode is None:
            result = run_standalone(args.cfg, opts, run_dir)
        else:
            result = run_launched(args.cfg, opts, run_dir, secure)
        wall = time.perf_counter() - started
        payload = payload_bytes(run_dir) / args.rounds / 2 ** 20
        wire = '–' if result['wire'] is None else f"{result['wire'] / args.rounds / 2 ** 20:.2f}"
        refused = '–' if result['refused'] is None else str(result['refused'])
        print(f"| {label} | {seconds_per_round(result['log']):.2f} | {payload:.2f} | {wire} | "
              f'{wall:.0f} | {refused} |', flush=True)
    if args.message_mb:
        from fs_plugins.commands.credentials import make_credentials
        folder = make_credentials(os.path.join(work, 'credentials'), [1])
        channels = (('plaintext', None), ('TLS + token', 'token'),
                    ('TLS + certificates', 'certificate'))
        times = {label: [] for label, _ in channels}
        for _ in range(3):   # interleaved: this machine's noise hits every channel alike
            for label, secure in channels:
                times[label].append(time_one_message(args.message_mb, secure, folder))
        print(f'\nOne {args.message_mb} MiB float32 update, client -> server, 127.0.0.1 '
              f'(median of 3, interleaved):')
        print('| channel | seconds | MiB/s (payload) | vs plaintext |\n|---|---|---|---|')
        base = statistics.median(times['plaintext'])
        for label, _ in channels:
            seconds = statistics.median(times[label])
            print(f'| {label} | {seconds:.2f} | {args.message_mb / seconds:.0f} | '
                  f'{seconds / base:.2f} |', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
