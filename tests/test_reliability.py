"""Reliability (issue 14): whole-federation checkpoint and resume, determinism, results that
are never lost, and the server's rejection of bad client updates."""
import copy
import json
import math
import os

import pytest
import torch
import toy_methods  # noqa: F401  (registers the test-only methods: covered like the others)
from helpers import method_params, run_embedded_keeping_clients, tiny_yaml_of, untimed_results_file, untimed_rows

from fs_plugins.methods.base import ClientUpdate
from fs_plugins.methods.registry import all_methods
from fs_plugins.run import checkpoint
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import ConfigError, load_config
from fs_plugins.run.validation import update_problem
from fs_plugins.sim import runner

METHODS = sorted(all_methods())
RESULT_FILES = ('results.jsonl', 'results.csv', 'summary.md')


class InjectedFault(RuntimeError):
    pass


def tiny_cfg(tmp_path, method: str, results: str, *opts, rounds: int = 2):
    return load_config(tiny_yaml_of(method), [
        'federate.total_round_num', str(rounds), 'train.local_update_steps', '2',
        'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
        'fsplug.results_dir', str(tmp_path / results), 'fsplug.checkpoint.freq', '1', *opts])


def crash_in(monkeypatch, where: str, round_idx: int):
    """Makes the run fail in `round_idx`: 'aggregate' after the clients trained, 'train' in a
    client's local round, 'checkpoint' while the server's checkpoint file is written."""
    targets = {'aggregate': (runner.ServerProcedure, 'aggregate'),
               'train': (ClientProcedure, 'run_round')}
    if where == 'checkpoint':
        original = checkpoint.write_party

        def failing(path, payload, info=None):
            if os.path.basename(path) == f'server.round{round_idx}.safetensors':
                raise InjectedFault('checkpoint write')
            return original(path, payload, info)
        monkeypatch.setattr(checkpoint, 'write_party', failing)
        return
    owner, name = targets[where]
    original = getattr(owner, name)

    def failing(self, index, *args):
        if index == round_idx:
            raise InjectedFault(where)
        return original(self, index, *args)
    monkeypatch.setattr(owner, name, failing)


def read(folder, name='results.jsonl') -> str:
    with open(os.path.join(folder, name), encoding='utf-8') as handle:
        return handle.read()


def read_rows(folder, name='results.jsonl') -> list[dict]:
    return [json.loads(line) for line in read(folder, name).splitlines()]


# full crash-and-resume on one method per kind of state a checkpoint must carry; every other
# method gets the state round trip below (its whole checkpoint, read back, equals the live state)
RESUMED_KINDS = {
    'fedavg': 'the global adapter only',
    'ditto': 'personalised adapters (a personal adapter beside the global one)',
    'fedadam': "server state (the server optimiser's moments)",
    'scaffold': 'extra payloads and client state (control variates)',
    'flame': 'extra payloads (activation counts), per-client expert budgets',
    'fedmole': 'phases (ADA: shared and routed phases)',
    'fedmosaic': 'client state (gradient EMA, relevance), gated global modules',
}


@pytest.mark.slow
@pytest.mark.parametrize('method', sorted(RESUMED_KINDS))
def test_a_run_stopped_and_resumed_ends_with_the_same_results(tmp_path, monkeypatch, method):
    """Round 0 is checkpointed, round 1 fails while its checkpoint is written, the resumed run
    repeats round 1: every results row equals the uninterrupted run's, byte for byte (the first
    round also shows that the same YAML and seed give the same numbers). No honest update is
    rejected by the server's checks. The uninterrupted run is the test's own, run just before
    (not the shared reference run): byte equality of float sums holds between runs close in a
    process's life, while the last bits may follow where its allocator put the tensors."""
    full = runner.run_embedded(tiny_cfg(tmp_path, method, 'full'))
    assert not [r for r in full.rows if r['kind'] == 'rejected']   # no honest update refused
    with monkeypatch.context() as patch:
        crash_in(patch, 'checkpoint', 1)   # after round 1's results rows
        with pytest.raises(InjectedFault):
            runner.run_embedded(tiny_cfg(tmp_path, method, 'cut'))
    cut = str(tmp_path / 'cut')
    assert checkpoint.latest_round(cut) == 0
    runner.run_embedded(tiny_cfg(tmp_path, method, 'cut', 'fsplug.checkpoint.resume_from', cut))
    for name in RESULT_FILES:
        assert untimed_results_file(tmp_path / 'full', name) == untimed_results_file(cut, name), name
    # the interrupted attempt's round-1 rows are kept aside, not lost
    superseded = read_rows(cut, 'results.superseded.jsonl')
    assert {(row['round'], row['kind']) for row in superseded} == {(1, 'train'), (1, 'eval'),
                                                                   (1, 'server')}


@pytest.mark.parametrize('method', method_params(METHODS))
def test_every_partys_checkpoint_holds_its_whole_state(reference_runs, method):
    """The state round trip of every method: the reference run's last checkpoint, read back
    into its parties' layout, equals what the server and each client hold at the end of the run
    (parameters, method state, extra artifacts, batch stream); the server's random generators
    are a well-formed state. No honest update was rejected."""
    reference = reference_runs.of(method)
    assert not [r for r in reference.results.rows if r['kind'] == 'rejected']
    last = checkpoint.latest_round(reference.results_dir)
    assert last == reference.server.cfg.federate.total_round_num - 1
    for cid, client in reference.clients.items():
        live = checkpoint.client_payload(client)
        path = checkpoint.party_path(reference.results_dir, checkpoint.client_party(cid), last)
        # read into a copy: objects saved through their state_dict are loaded into the target
        assert_same_state(checkpoint.read_party(path, copy.deepcopy(live)), live, f'client {cid}')
    live = checkpoint.server_payload(reference.server)
    path = checkpoint.party_path(reference.results_dir, 'server', last)
    saved = checkpoint.read_party(path, copy.deepcopy(live))
    checkpoint.check_rng_state(saved.pop('rng'))
    live.pop('rng')
    assert_same_state(saved, live, 'server')


def assert_same_state(saved, live, where: str) -> None:
    """Equal nested state: tensors equal in dtype, shape and values; NaN equals NaN."""
    if isinstance(live, torch.Tensor):
        assert isinstance(saved, torch.Tensor) and saved.dtype == live.dtype, where
        assert torch.equal(saved, live), where
    elif isinstance(live, dict):
        assert isinstance(saved, dict) and set(saved) == set(live), \
            f'{where}: keys {sorted(map(str, saved))} != {sorted(map(str, live))}'
        for key in live:
            assert_same_state(saved[key], live[key], f'{where}.{key}')
    elif isinstance(live, (list, tuple)):
        assert isinstance(saved, (list, tuple)) and len(saved) == len(live), where
        for i, (a, b) in enumerate(zip(saved, live)):
            assert_same_state(a, b, f'{where}[{i}]')
    elif isinstance(live, float) and math.isnan(live):
        assert isinstance(saved, float) and math.isnan(saved), where
    elif hasattr(live, 'state_dict'):   # objects restored in place (a batch stream)
        assert_same_state(saved.state_dict(), live.state_dict(), where)
    else:
        assert saved == live, f'{where}: {saved!r} != {live!r}'


@pytest.mark.slow
def test_the_same_yaml_and_seed_give_identical_results_files(tmp_path):
    for name in ('first', 'second'):
        runner.run_embedded(tiny_cfg(tmp_path, 'flame', name, rounds=2))
    for name in RESULT_FILES:
        assert untimed_results_file(tmp_path / 'first', name) == \
            untimed_results_file(tmp_path / 'second', name), name


@pytest.mark.slow
@pytest.mark.parametrize('where', ['train', 'aggregate', 'checkpoint'])
def test_a_fault_anywhere_in_a_round_leaves_a_checkpoint_to_resume(tmp_path, monkeypatch, where):
    runner.run_embedded(tiny_cfg(tmp_path, 'fedmole', 'full', rounds=3))
    with monkeypatch.context() as patch:
        crash_in(patch, where, 2)
        with pytest.raises(InjectedFault):
            runner.run_embedded(tiny_cfg(tmp_path, 'fedmole', 'cut', rounds=3))
    cut = str(tmp_path / 'cut')
    folder = checkpoint.checkpoint_dir(cut)
    assert not [n for n in os.listdir(folder) if '.tmp-' in n]   # no half-written file
    assert checkpoint.latest_round(cut) == 1
    rows_before = read(cut).count('\n')
    runner.run_embedded(tiny_cfg(tmp_path, 'fedmole', 'cut', 'fsplug.checkpoint.resume_from',
                                 cut, rounds=3))
    assert untimed_results_file(tmp_path / 'full', 'results.jsonl') == \
        untimed_results_file(cut, 'results.jsonl')
    assert rows_before >= 1


def test_resume_refuses_a_different_config_and_a_missing_checkpoint(tmp_path):
    runner.run_embedded(tiny_cfg(tmp_path, 'fedavg', 'run', rounds=1))
    run = str(tmp_path / 'run')
    with pytest.raises(ConfigError, match=r'train\.optimizer\.lr'):
        runner.run_embedded(tiny_cfg(tmp_path, 'fedavg', 'run', 'fsplug.checkpoint.resume_from',
                                     run, 'train.optimizer.lr', '0.5', rounds=2))
    with pytest.raises(checkpoint.CheckpointError, match='has no server checkpoint'):
        runner.run_embedded(tiny_cfg(tmp_path, 'fedavg', 'other', 'fsplug.checkpoint.resume_from',
                                     str(tmp_path / 'nowhere')))


@pytest.mark.slow
def test_a_finished_run_resumed_with_more_rounds_continues_it(tmp_path):
    runner.run_embedded(tiny_cfg(tmp_path, 'fedavg', 'full', rounds=3))
    runner.run_embedded(tiny_cfg(tmp_path, 'fedavg', 'grown', rounds=2))
    grown = str(tmp_path / 'grown')
    runner.run_embedded(tiny_cfg(tmp_path, 'fedavg', 'grown', 'fsplug.checkpoint.resume_from',
                                 grown, rounds=3))
    full, resumed = untimed_rows(read_rows(tmp_path / 'full')), untimed_rows(read_rows(grown))
    # round 1's evaluation is the last of the 2-round run and an ordinary one of the 3-round run
    for kind in ('train', 'server'):
        assert [r for r in full if r['kind'] == kind] == [r for r in resumed if r['kind'] == kind]


# ------------------------------------------------------------------ results never lost
def test_an_existing_results_directory_is_refused_unless_overwritten(tmp_path, capsys):
    from fs_plugins.commands.cli import main
    runner.run_embedded(tiny_cfg(tmp_path, 'fedavg', 'run', rounds=1))
    before, untimed_before = read(tmp_path / 'run'), untimed_results_file(tmp_path / 'run', 'results.jsonl')
    with pytest.raises(ConfigError, match='already holds a run'):
        runner.run_embedded(tiny_cfg(tmp_path, 'fedavg', 'run', rounds=1))
    assert read(tmp_path / 'run') == before
    yaml_path = tiny_yaml_of('fedavg')
    opts = ['federate.total_round_num', '1', 'train.local_update_steps', '2', 'data.root',
            str(tmp_path / 'data'), 'fsplug.results_dir', str(tmp_path / 'run')]
    assert main(['run', '--runner', 'embedded', '--cfg', yaml_path, *opts]) == 2
    assert '--overwrite' in capsys.readouterr().err and read(tmp_path / 'run') == before
    assert main(['run', '--runner', 'embedded', '--overwrite', '--cfg', yaml_path, *opts]) == 0
    # the same run again, replaced (not appended to)
    assert untimed_results_file(tmp_path / 'run', 'results.jsonl') == untimed_before


def test_an_interrupted_run_keeps_every_finished_rounds_results(tmp_path, monkeypatch):
    crash_in(monkeypatch, 'train', 2)
    with pytest.raises(InjectedFault):
        runner.run_embedded(tiny_cfg(tmp_path, 'fedavg', 'cut', 'fsplug.checkpoint.freq', '0',
                                     rounds=3))
    rows = read_rows(tmp_path / 'cut')
    assert {(r['round'], r['kind']) for r in rows} == {(0, 'train'), (0, 'eval'), (0, 'server'),
                                                        (1, 'train'), (1, 'eval'), (1, 'server')}
    assert os.path.isfile(tmp_path / 'cut' / 'summary.md')
    # ... and says it did not go to its end (a run that does says so: test_reproduce)
    with open(tmp_path / 'cut' / 'run_info.json') as handle:
        assert json.load(handle)['completed'] is False


# ------------------------------------------------------------------ checkpoint format
def test_pack_and_unpack_keep_nested_state_and_restore_objects_in_place(tmp_path):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {'n': self.n}

        def load_state_dict(self, state):
            self.n = state['n']
    saved_counter, fresh_counter = Counter(), Counter()
    saved_counter.n = 7
    state = {'t': torch.arange(4.), 'b16': torch.ones(2, dtype=torch.bfloat16),
             'by_sig': {(('a', (2, 3)),): {'x': torch.zeros(1)}}, 3: [1, 2.5, None, 'z'],
             'tuple': (1, torch.ones(1)), 'counter': saved_counter, 'nan': float('nan')}
    path = str(tmp_path / 'party.safetensors')
    checkpoint.write_party(path, state, {'round': 4})
    back = checkpoint.read_party(path, {'counter': fresh_counter})
    assert back['counter'] is fresh_counter and fresh_counter.n == 7
    assert torch.equal(back['t'], state['t']) and back['b16'].dtype == torch.bfloat16
    assert torch.equal(back['by_sig'][(('a', (2, 3)),)]['x'], torch.zeros(1))
    assert back[3] == [1, 2.5, None, 'z'] and math.isnan(back['nan'])
    assert isinstance(back['tuple'], tuple) and checkpoint.read_info(path) == {'round': 4}


def test_state_without_state_dict_is_named_when_checkpointing(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match=r"'party/state/thing' holds a object"):
        checkpoint.write_party(str(tmp_path / 'party.safetensors'), {'state': {'thing': object()}})


def test_a_batch_stream_continues_where_its_state_was_taken():
    from fs_plugins.data.batches import BatchStream
    data = list(range(10))

    def stream():
        return BatchStream(data, lambda rows: rows, 3, seed=5, client_id=2)
    first = stream()
    for _ in range(5):
        first.next()
    second = stream()
    second.load_state_dict(first.state_dict())
    assert [first.next() for _ in range(6)] == [second.next() for _ in range(6)]


# ------------------------------------------------------------------ update validation
EXPECTED = {'a': (2, 3), 'b': (3,)}


def update(**changes):
    shared = {'a': torch.ones(2, 3), 'b': torch.ones(3)}
    shared.update(changes)
    return {k: v for k, v in shared.items() if v is not None}


@pytest.mark.parametrize('shared, extra, reason', [
    (update(a=torch.full((2, 3), float('nan'))), {}, r'shared a \(2, 3\) has non-finite'),
    (update(b=torch.tensor([1., float('inf'), 0.])), {}, 'shared b .* non-finite'),
    (update(), {'counts': torch.tensor([float('nan')])}, 'extra counts .* non-finite'),
    (update(a=torch.ones(3, 2)), {}, r'shared a has shape \(3, 2\), expected \(2, 3\)'),
    (update(b=None), {}, r'missing shared tensor\(s\) b'),
    (update(c=torch.ones(1)), {}, r'unexpected shared tensor\(s\) c'),
    (update(a=torch.full((2, 3), 1e6)), {}, 'norm .* exceeds fsplug.validation.max_update_norm'),
    (update(a=[1.0, 2.0]), {}, 'shared a is a list, not a tensor'),
])
def test_each_kind_of_bad_update_is_named(shared, extra, reason):
    assert update_problem(update(), {}, EXPECTED, 1e5) is None
    problem = update_problem(shared, extra, EXPECTED, 1e5)
    assert problem is not None
    import re
    assert re.search(reason, problem), problem


BAD_UPDATES = {
    'nan': lambda shared: {**shared, next(iter(shared)): shared[next(iter(shared))] * float('nan')},
    'inf': lambda shared: {**shared, next(iter(shared)): shared[next(iter(shared))] + float('inf')},
    'wrong shape': lambda shared: {**shared, next(iter(shared)): torch.zeros(1, 1)},
    'missing key': lambda shared: dict(list(shared.items())[1:]),
    'extra key': lambda shared: {**shared, 'base_model.injected.weight': torch.zeros(2)},
    'absurd norm': lambda shared: {k: v * 1e9 for k, v in shared.items()},
}


@pytest.mark.parametrize('kind', sorted(BAD_UPDATES))
def test_the_server_rejects_a_bad_update_and_aggregates_the_rest(tmp_path, monkeypatch, kind):
    """Client 2's update is corrupted in round 0: it is rejected with a log line and a results
    row naming client and reason; the global state is the average of the other clients."""
    original = ClientProcedure.end_round

    def corrupted(self):
        result = original(self)
        if self.client_id == 2 and self.round_idx == 0:
            result.shared = BAD_UPDATES[kind](result.shared)
        return result
    monkeypatch.setattr(ClientProcedure, 'end_round', corrupted)
    captured = {}
    aggregate = runner.ServerProcedure.aggregate

    def spy(self, round_idx, updates):
        captured.setdefault(round_idx, [u for u in updates if u.client_id != 2])
        return aggregate(self, round_idx, updates)
    monkeypatch.setattr(runner.ServerProcedure, 'aggregate', spy)
    results, _ = run_embedded_keeping_clients(tiny_cfg(tmp_path, 'fedavg', 'run', rounds=1))
    rejected = [r for r in results.rows if r['kind'] == 'rejected']
    assert [(r['round'], r['client']) for r in rejected] == [(0, 2)]
    honest = captured[0]
    assert len(honest) >= 1 and math.isfinite(results.final_rows()[1][-1]['test_avg_loss'])


def test_a_client_with_its_own_config_is_checked_against_its_own_model(tmp_path):
    """The shapes the server expects from a client whose config differs (here a LoRA rank)
    are those of that client's model, built on the meta device."""
    from fs_plugins.methods.building import build_model
    from fs_plugins.run.server import client_shared_shapes
    cfg = tiny_cfg(tmp_path, 'fedavg', 'run', 'fsplug.model.lora.r', '4')
    method = all_methods()['fedavg'](cfg)
    built = build_model(cfg, method)
    own = {n: tuple(t.shape) for n, t in method.shared_tensors(built.model,
                                                               built.trainable_names).items()}
    assert client_shared_shapes(cfg, type(method)) == own
    assert any(4 in shape for shape in own.values())


def fedavg_server(initial: dict):
    """A FedAvg ServerProcedure over `initial` whose results rows stay in memory."""
    from fs_plugins.run.results import ResultsLog
    from fs_plugins.run.server import ServerProcedure

    class MemoryLog(ResultsLog):
        def __init__(self):
            self.rows = []

        def log(self, row):
            self.rows.append(row)
    cfg = load_config(tiny_yaml_of('fedavg'), [])
    return ServerProcedure(cfg, all_methods()['fedavg'](cfg), initial, MemoryLog())


def test_a_round_without_a_valid_update_keeps_the_state():
    server = fedavg_server({'w': torch.ones(2)})
    server.aggregate(0, [ClientUpdate(1, 4, {'w': torch.full((2,), float('nan'))}, {}, {})])
    assert torch.equal(server.state['global']['w'], torch.ones(2))
    assert server.rejections == [{'round': 0, 'client': 1,
                                  'reason': 'shared w (2,) has non-finite values (NaN/Inf)'}]


def test_a_server_without_the_clients_configs_expects_its_own_model():
    """A distributed server may lack the clients' --client_cfg: a client without a known config
    must send the run's own model, as the server builds it; its first update never defines what
    it may send (issue 41)."""
    server = fedavg_server({'w': torch.ones(2)})
    server.all_client_configs_known = False
    bigger = ClientUpdate(2, 4, {'w': torch.ones(3)}, {}, {})
    assert server.accepted(0, [bigger]) == []
    assert 'shared w has shape (3,), expected (2,)' in server.rejections[0]['reason']
    assert '--client_cfg' in server.rejections[0]['reason']
    fitting = ClientUpdate(2, 4, {'w': torch.ones(2)}, {}, {}, dataset_size=4)
    assert server.accepted(1, [fitting]) == [fitting]
