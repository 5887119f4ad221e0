"""Small YAMLs for tests, derived from the shipped tiny YAML; the shipped YAMLs; a run's
results without their times."""
import copy
import csv
import glob
import importlib.util
import json
import os

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(REPO, 'yamls', 'fedavg', 'tiny.yaml')
# the heading of summary.md's last section, the time split (fs_plugins.run.results)
TIME_SECTION = "\nWhere the rounds' time went"
TESTS_DIR = os.path.join(REPO, 'tests')
# FS-LLM's own baseline YAMLs plus fsplug.method: they carry FS keys only FederatedScope
# honours (early_stop, federate.save_to, criterion, llm.chat), so they run through FS only
# (tests/test_fs_llm_yamls.py), not the embedded runner
FS_ONLY_YAMLS = os.path.join('yamls', 'fs_llm')
HAVE_FS = importlib.util.find_spec('federatedscope') is not None
NO_FS_REASON = ('FederatedScope is not installed (its llm branch: docs/install.md); '
                '`.ci/run` installs it and runs this test')
# the fast tier's few tests through FederatedScope (tests/test_runners.py): skipped without it,
# like the fs tier's (tests/conftest.py), but not in that tier
requires_fs = pytest.mark.skipif(not HAVE_FS, reason=NO_FS_REASON)


def shipped_yamls() -> list[str]:
    """Every shipped YAML the embedded runner loads (paths relative to the repository)."""
    paths = glob.glob(os.path.join(REPO, 'yamls', '**', '*.yaml'), recursive=True)
    return sorted(rel for rel in (os.path.relpath(p, REPO) for p in paths)
                  if not rel.startswith(FS_ONLY_YAMLS + os.sep))


def env_with_tests(**extra) -> dict:
    """The environment for a subprocess that imports the test-only modules (toy methods)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get('PYTHONPATH', '')]))
    env.update(extra)
    return env


class CreatesFile:
    """Creates the file `path` when unpickled: what a receiver must never do with a payload."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, 'w'))


def deep_update(base: dict, update: dict) -> dict:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_update(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def tiny_config(tmp_path, method='fedavg', rounds=2, steps=3, **updates) -> dict:
    with open(TINY_YAML) as handle:
        cfg = yaml.safe_load(handle)
    deep_update(cfg, {
        'expname': f'{method}_test', 'outdir': str(tmp_path / 'exp'),
        'federate': {'total_round_num': rounds},
        'data': {'root': str(tmp_path / 'data')},
        'train': {'local_update_steps': steps},
        'fsplug': {'method': method, 'results_dir': str(tmp_path / 'results')},
    })
    return deep_update(cfg, updates)


def write_yaml(path, cfg: dict) -> str:
    with open(path, 'w') as handle:
        yaml.safe_dump(cfg, handle)
    return str(path)


def run_embedded_keeping_parties(cfg, client_cfgs=None):
    """Runs the embedded runner on a loaded config; returns (results log, {client id:
    ClientProcedure}, ServerProcedure) so tests can inspect the parties after the run."""
    from fs_plugins.sim import runner as runner_mod
    captured, servers = {}, []
    build_clients, server_class = runner_mod.build_clients, runner_mod.ServerProcedure

    def spy_clients(*args, **kwargs):
        captured.update(build_clients(*args, **kwargs))
        return captured

    def spy_server(*args, **kwargs):
        servers.append(server_class(*args, **kwargs))
        return servers[-1]
    runner_mod.build_clients, runner_mod.ServerProcedure = spy_clients, spy_server
    try:
        results = runner_mod.run_embedded(cfg, client_cfgs)
    finally:
        runner_mod.build_clients, runner_mod.ServerProcedure = build_clients, server_class
    return results, captured, servers[-1]


def run_embedded_keeping_clients(cfg, client_cfgs=None):
    """`run_embedded_keeping_parties` without the server: (results log, {client id:
    ClientProcedure})."""
    results, clients, _ = run_embedded_keeping_parties(cfg, client_cfgs)
    return results, clients


def method_params(methods, fast=('fedavg',)) -> list:
    """pytest params of `methods`, those not in `fast` marked slow: fedavg's case is the fast
    tier's, every other method's is in the slow tier."""
    return [pytest.param(m, marks=() if m in fast else pytest.mark.slow) for m in methods]


def assert_reloaded_models_match(results, clients) -> None:
    """Each client's model rebuilt from the run's folder (fs_plugins.load_trained) gives the
    run's own logits, exactly, on two of its test records."""
    import torch

    from fs_plugins import load_trained
    for cid, proc in clients.items():
        built = load_trained(results.out_dir, client=cid)
        batch = proc.collate([proc.eval_data['test'][i] for i in range(2)])
        batch.pop('labels')
        built.model.eval()
        proc.model.eval()
        with torch.no_grad():
            torch.testing.assert_close(built.model(**batch).logits, proc.model(**batch).logits,
                                       rtol=0, atol=0)


def tiny_yaml_of(method: str) -> str:
    """A registered method's tiny YAML: yamls/<name>/tiny.yaml, or tests/yamls/<name>/tiny.yaml
    for the test-only methods."""
    for root in (os.path.join(REPO, 'yamls'), os.path.join(REPO, 'tests', 'yamls')):
        path = os.path.join(root, method, 'tiny.yaml')
        if os.path.isfile(path):
            return path
    raise AssertionError(f"method '{method}' has no tiny YAML: add yamls/{method}/tiny.yaml")


def outsiders_are_refused(server_port: int, security, other_ca: str | None = None) -> str:
    """Joins tried against a live secured server (`security`: fs_plugins.commands.launch.Security): over
    plaintext, with a certificate from another CA (with `other_ca`, a credentials folder),
    and with client 1's credentials claiming client 2. Raises when one gets in (also used by
    scripts/bench_distributed.py); returns the line the server logs for the last."""
    import grpc
    from federatedscope.core.message import Message
    from federatedscope.core.proto import gRPC_comm_manager_pb2_grpc

    from fs_plugins.commands.credentials import party_distribute
    from fs_plugins.fs.secure import CredentialsRefused, party_comm_manager
    address = f'127.0.0.1:{server_port}'
    join = Message(msg_type='join_in', sender=2, receiver=[0], state=0, timestamp=0,
                   content={'host': '127.0.0.1', 'port': 1})
    with grpc.insecure_channel(address) as channel:
        try:
            gRPC_comm_manager_pb2_grpc.gRPCComServeFuncStub(channel).sendMessage(
                join.transform(), timeout=10)
            raise AssertionError('a plaintext join was accepted')
        except grpc.RpcError:
            pass
    attempts = [(other_ca, ConnectionError)] if other_ca else []
    attempts.append((security.folder, CredentialsRefused))
    for folder, refusal in attempts:
        distribute = dict(party_distribute(folder, 'client_1', security.auth), connect_timeout_s=5.0)
        manager = party_comm_manager('client', distribute)
        manager.add_neighbors(0, address)
        try:
            manager.send(join)
            raise AssertionError(f"client 1's credentials from {folder} were accepted for client 2")
        except refusal:
            pass
        finally:
            manager.grpc_server.stop(0)
    return 'refused a message claiming to come from client 2'


def untimed_rows(rows: list[dict]) -> list[dict]:
    """The rows without their time columns (fs_plugins.run.results.is_time_column); a server
    row keeps its round, client and kind, so where each row falls is still compared. Two runs
    of one config and seed agree on these, not on the seconds."""
    from fs_plugins.run.results import is_time_column
    return [{k: v for k, v in row.items() if not is_time_column(k)} for row in rows]


def untimed_results_file(folder, name: str):
    """A run's results file without what differs from run to run: results.jsonl (or
    results.superseded.jsonl) as untimed_rows, results.csv as its lines of cells without the
    time columns, summary.md up to its time section (which must be there)."""
    from fs_plugins.run.results import is_time_column
    with open(os.path.join(folder, name), encoding='utf-8', newline='') as handle:
        if name.endswith('.jsonl'):
            return untimed_rows([json.loads(line) for line in handle if line.strip()])
        if name.endswith('.csv'):
            lines = list(csv.reader(handle))
            kept = [i for i, column in enumerate(lines[0]) if not is_time_column(column)]
            return [[line[i] for i in kept] for line in lines]
        text = handle.read()
    before, found, _ = text.partition(TIME_SECTION)
    assert found, f"{name} in {folder} has no section '{TIME_SECTION.strip()}'"
    return before
