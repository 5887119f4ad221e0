"""A federation that survives its own clients (issue 41, points 1-2): every malformed or hostile
update is a rejection naming the client and the reason, the round goes on with the honest ones,
and robust aggregation bounds what one client among five can move. Runs the server procedure
directly (no FS, no model build)."""
import base64
import json
import math
import statistics
import struct

import pytest
import torch
from helpers import tiny_yaml_of

from fs_plugins.aggregation.average import capped_dataset_size, weighted_average
from fs_plugins.aggregation.robust import (
    RobustAverage,
    clip_update,
    coordinate_median,
    robust_averaging,
    trimmed_mean,
)
from fs_plugins.core.errors import ConfigError
from fs_plugins.fs.wire import MARKER, PAYLOAD, WireError, decode_tensors, decode_update, decoded_updates, encode_update
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.methods.registry import all_methods
from fs_plugins.methods.scaffold import CONTROL
from fs_plugins.run.config import load_config
from fs_plugins.run.results import ResultsLog
from fs_plugins.run.server import ServerProcedure
from fs_plugins.schema.validate import robust_problems

HONEST = (1, 2, 3, 4)
ATTACKER = 5
SIZE = 10   # every honest client's training-set size


class MemoryLog(ResultsLog):
    def __init__(self):
        self.rows = []

    def log(self, row):
        self.rows.append(row)


def server_of(method='fedavg', *opts, initial=None, distributed=False) -> ServerProcedure:
    cfg = load_config(tiny_yaml_of(method), list(opts))
    server = ServerProcedure(cfg, all_methods()[method](cfg),
                             initial if initial is not None else {'w': torch.zeros(4)}, MemoryLog())
    server.all_client_configs_known = not distributed
    return server


def honest_update(cid: int, sent: dict, extra=None) -> ClientUpdate:
    """A small step away from what the client was sent."""
    shared = {n: t + 0.01 * cid for n, t in sent.items()}
    return ClientUpdate(cid, 8, shared, extra or {}, {'train_avg_loss': 1.0}, dataset_size=SIZE)


def honest_round(server, round_idx: int, attack=None, extra=None) -> list[ClientUpdate]:
    """Every client gets its content; the honest ones answer honestly, the attacker with
    `attack(sent)` (an update) when given; `sent`: the content's shared tensor 'w'."""
    sent = {cid: {'w': server.content_for(cid)['w']} for cid in HONEST + (ATTACKER,)}
    updates = [honest_update(cid, sent[cid], extra) for cid in HONEST]
    if attack is not None:
        updates.append(attack(sent[ATTACKER]))
    server.aggregate(round_idx, updates)
    return updates


def assert_rejected(server, round_idx: int, reason: str) -> None:
    rejected = [r for r in server.results.rows if r['kind'] == 'rejected']
    assert [(r['round'], r['client']) for r in rejected] == [(round_idx, ATTACKER)], rejected
    assert reason in rejected[0]['reason'], rejected[0]['reason']
    assert server.rejections[-1]['client'] == ATTACKER


def honest_mean(updates, name='w') -> torch.Tensor:
    return torch.stack([u.shared[name] for u in updates if u.client_id in HONEST]).mean(0)


# ------------------------------------------------------------------ the wire (point 1)
def blob(header_json: bytes) -> str:
    return base64.b64encode(struct.pack('<Q', len(header_json)) + header_json).decode()


def wire_round(server, attacker_content, num_samples=8):
    """Round 0 as the FS server runs it: decode every message, aggregate what decodes."""
    received = {}
    for cid in HONEST:
        sent = server.content_for(cid)
        received[cid] = (8, encode_update(honest_update(cid, sent), distributed=True))
    server.content_for(ATTACKER)
    received[ATTACKER] = (num_samples, attacker_content)
    updates = decoded_updates(received, lambda cid, reason: server.reject(0, cid, reason))
    server.aggregate(0, updates)
    return updates


def forged(**changes) -> dict:
    """The attacker's encoded update with fields of its flat dict replaced."""
    update = honest_update(ATTACKER, {'w': torch.zeros(4)})
    content = encode_update(update, distributed=False)
    content.update(changes)
    content.pop(MARKER)
    from fs_plugins.fs.wire import to_blob
    return {MARKER: 1, PAYLOAD: to_blob(content)}


@pytest.mark.parametrize('attack, num_samples, reason', [
    ({MARKER: 1, PAYLOAD: blob(b'{"a":' + b'[' * 100000 + b']' * 100000 + b'}')}, 8,
     'unreadable header (RecursionError'),
    (forged(), float('inf'), 'num_samples = inf is not a whole number'),
    (forged(), 1e15, 'num_samples = 1000000000000000.0 is not in [0, 1e+12]'),
    (forged(**{'meta/dataset_size': 0}), 8, "meta/dataset_size = 0 is not in [1, 1e+12]"),
    (forged(**{'meta/dataset_size': -3}), 8, "meta/dataset_size = -3 is not in [1, 1e+12]"),
    (forged(**{'meta/dataset_size': 10 ** 15}), 8, 'is not in [1, 1e+12]'),
    (forged(**{'meta/dataset_size': float('inf')}), 8, 'meta/dataset_size = inf is not a whole'),
    (forged(**{'meta/dataset_size': 'ten'}), 8, "meta/dataset_size = 'ten' is not a number"),
    (forged(**{'metric/train_avg_loss': float('-inf')}), 8, "metric 'train_avg_loss' = -inf"),
    (forged(**{'metric/train_avg_loss': 'low'}), 8, "metric 'train_avg_loss' = 'low'"),
    (['not', 'a', 'dict'], 8, 'content from client 5 is a list'),
])
def test_an_undecodable_update_is_rejected_and_the_round_goes_on(attack, num_samples, reason):
    server = server_of()
    updates = wire_round(server, attack, num_samples)
    assert sorted(u.client_id for u in updates) == list(HONEST)
    assert_rejected(server, 0, reason)
    assert 'client 5' in server.rejections[-1]['reason']
    assert torch.allclose(server.state['global']['w'], torch.full((4,), 0.025))


def test_every_decoding_error_is_a_wire_error():
    nested = {MARKER: 1, PAYLOAD: blob(b'[' * 100000 + b']' * 100000)}
    with pytest.raises(WireError, match='client 7'):
        decode_update(7, 8, nested)
    with pytest.raises(WireError, match='the server'):
        decode_tensors(nested)


# ------------------------------------------------------------------ tensors (point 1)
def test_a_wrong_shape_in_a_first_update_is_rejected_against_the_servers_own_model():
    """A distributed server without the clients' configs: the signature is its own build's."""
    server = server_of(distributed=True)
    honest_round(server, 0, lambda sent: ClientUpdate(ATTACKER, 8, {'w': torch.ones(7)},
                                                      dataset_size=SIZE))
    assert_rejected(server, 0, 'shared w has shape (7,), expected (4,)')
    assert server.state['global']['w'].shape == (4,)
    honest_round(server, 1)   # the honest clients carry on


def test_an_integer_tensor_of_1e9_is_rejected_and_honest_clients_carry_on():
    server = server_of()
    huge = lambda sent: ClientUpdate(ATTACKER, 8, {'w': torch.full((4,), 10 ** 9)},  # noqa: E731
                                     dataset_size=SIZE)
    updates = honest_round(server, 0, huge)
    assert_rejected(server, 0, 'shared w has dtype int64, expected float32')
    assert server.state['global']['w'].dtype == torch.float32
    assert torch.equal(server.state['global']['w'], honest_mean(updates))
    honest_round(server, 1)
    assert len(server.rejections) == 1   # the next honest updates pass the norm check


def test_a_bool_tensor_is_checked_too():
    server = server_of()
    honest_round(server, 0, lambda sent: ClientUpdate(ATTACKER, 8, {'w': torch.ones(4, dtype=torch.bool)},
                                                      dataset_size=SIZE))
    assert_rejected(server, 0, 'has dtype bool, expected float32')


def test_extra_tensor_names_never_reach_the_global_state():
    server = server_of()
    injected = lambda sent: ClientUpdate(  # noqa: E731
        ATTACKER, 8, {**sent, 'base_model.injected.weight': torch.zeros(2)}, dataset_size=SIZE)
    honest_round(server, 0, injected)
    assert_rejected(server, 0, 'unexpected shared tensor(s) base_model.injected.weight')
    assert all(set(server.content_for(cid)) == {'w'} for cid in HONEST)


def test_the_norm_bound_applies_to_the_change_against_what_was_sent():
    """A global state far from 0 passes (its change is small); a large change does not."""
    server = server_of('fedavg', 'fsplug.validation.max_update_norm', '1',
                       initial={'w': torch.full((4,), 1000.0)})
    honest_round(server, 0, lambda sent: ClientUpdate(ATTACKER, 8, {'w': sent['w'] + 3},
                                                      dataset_size=SIZE))
    assert_rejected(server, 0, 'L2 norm of the change of the shared tensors 6 exceeds '
                               'fsplug.validation.max_update_norm = 1')
    assert torch.allclose(server.state['global']['w'], torch.full((4,), 1000.025))


def scaffold_server(*opts):
    return server_of('scaffold', *opts, initial={'w': torch.zeros(4)})


def test_extra_payloads_are_bounded_and_must_be_declared():
    server = scaffold_server('fsplug.validation.max_extra_norm', '100')
    control = CONTROL + 'w'
    small = {control: torch.full((4,), 0.1)}
    honest_round(server, 0, lambda sent: ClientUpdate(
        ATTACKER, 8, dict(sent), {control: torch.full((4,), 1e6)}, dataset_size=SIZE), extra=small)
    assert_rejected(server, 0, 'L2 norm of the extra payload 2e+06 exceeds '
                               'fsplug.validation.max_extra_norm = 100')
    server = scaffold_server()
    honest_round(server, 0, lambda sent: ClientUpdate(
        ATTACKER, 8, dict(sent), {'smuggled': torch.ones(1)}, dataset_size=SIZE), extra=small)
    assert_rejected(server, 0, 'unexpected extra payload(s) smuggled')


def test_a_dataset_size_under_one_is_rejected_when_it_weighs():
    server = server_of()
    honest_round(server, 0, lambda sent: ClientUpdate(ATTACKER, 8, dict(sent), dataset_size=0))
    assert_rejected(server, 0, 'dataset_size = 0 is not in [1, 1e+12]')


def test_the_average_keeps_the_global_dtype_and_accumulates_in_float32():
    halves = [torch.tensor([1.0, 2.0 ** -9], dtype=torch.bfloat16)] * 3
    got = weighted_average([{'w': t} for t in halves], [1, 1, 1])['w']
    assert got.dtype == torch.bfloat16 and torch.equal(got, halves[0])
    with pytest.raises(ValueError, match="'w': clients sent different dtypes"):
        weighted_average([{'w': torch.ones(2)}, {'w': torch.ones(2, dtype=torch.int64)}], [1, 1])


# ------------------------------------------------------------------ bounded influence (point 2)
def test_self_reported_sizes_are_capped():
    assert capped_dataset_size(10 ** 12, None, 0) == 10 ** 12
    assert capped_dataset_size(10 ** 12, None, 100) == 100
    assert capped_dataset_size(10 ** 12, 40, 100) == 40
    assert capped_dataset_size(30, 40, 100) == 30


@pytest.mark.parametrize('known', [False, True])
def test_a_huge_reported_size_cannot_take_the_global_state_over(known):
    server = server_of('fedavg', 'fsplug.aggregation.max_dataset_size', str(SIZE))
    if known:
        server.cfg.fsplug.aggregation.max_dataset_size = 0
        server.known_dataset_sizes = {cid: SIZE for cid in HONEST + (ATTACKER,)}
    updates = honest_round(server, 0, lambda sent: ClientUpdate(
        ATTACKER, 8, {'w': sent['w'] + 0.5}, dataset_size=10 ** 12))
    values = [u.shared['w'] for u in updates]
    assert not server.rejections
    assert torch.equal(server.state['global']['w'], weighted_average(
        [{'w': v} for v in values], [SIZE] * 5)['w'])


def attacked_round(*opts, push=1e4):
    """Round 0 of five clients, the fifth pushing every coordinate by `push`."""
    server = server_of('fedavg', 'fsplug.validation.max_update_norm', '0', *opts)
    updates = honest_round(server, 0, lambda sent: ClientUpdate(
        ATTACKER, 8, {'w': sent['w'] + push}, dataset_size=SIZE))
    return server, torch.stack([u.shared['w'] for u in updates])


def naive_median(rows: torch.Tensor) -> torch.Tensor:
    return torch.tensor([statistics.median(col) for col in rows.T.tolist()], dtype=rows.dtype)


def naive_trimmed_mean(rows: torch.Tensor, fraction: float) -> torch.Tensor:
    cut = int(fraction * rows.shape[0])
    kept = [sorted(col)[cut:len(col) - cut] for col in rows.T.tolist()]
    return torch.tensor([math.fsum(col) / len(col) for col in kept], dtype=rows.dtype)


def test_median_bounds_one_attacker_among_five():
    server, rows = attacked_round('fsplug.aggregation.robust.average', 'median')
    got = server.state['global']['w']
    assert torch.equal(got, naive_median(rows))
    honest = rows[:4]
    assert bool((got >= honest.min(0).values).all() and (got <= honest.max(0).values).all())


def test_trimmed_mean_bounds_one_attacker_among_five():
    server, rows = attacked_round('fsplug.aggregation.robust.average', 'trimmed_mean',
                                  'fsplug.aggregation.robust.trim_fraction', '0.2')
    got = server.state['global']['w']
    torch.testing.assert_close(got, naive_trimmed_mean(rows, 0.2), rtol=0, atol=1e-6)
    honest = rows[:4]
    assert bool((got >= honest.min(0).values).all() and (got <= honest.max(0).values).all())


def test_clipping_bounds_one_attackers_pull_to_its_weight_times_the_clip():
    clip = 0.5
    server, rows = attacked_round('fsplug.aggregation.robust.clip_norm', str(clip))
    without, _ = attacked_round('fsplug.aggregation.robust.clip_norm', str(clip), push=0.0)
    moved = float((server.state['global']['w'] - without.state['global']['w']).norm())
    assert moved <= clip / 5 + 1e-6
    # the attacker's delta clipped exactly: sent + delta · clip / ‖delta‖
    delta = rows[4] - 0.0
    clipped = delta * (clip / float(delta.norm()))
    expected = (rows[:4].sum(0) + clipped) / 5
    torch.testing.assert_close(server.state['global']['w'], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize('mode', ['median', 'trimmed_mean'])
def test_a_method_whose_aggregation_is_not_an_average_refuses_robust_averages(mode):
    with pytest.raises(ConfigError, match=f"robust.average = '{mode}' does not apply to hetlora"):
        server_of('hetlora', 'fsplug.aggregation.robust.average', mode)
    server_of('hetlora', 'fsplug.aggregation.robust.clip_norm', '1')   # clipping applies to all


def test_every_method_either_averages_or_says_why_not():
    refusing = {name for name, cls in all_methods().items() if cls.robust_aggregation_refusal}
    assert {'hetlora', 'flexlora', 'fed_a2', 'flame', 'fedmosaic', 'flora', 'frlora', 'fedex',
            'lorahub', 'perada', 'uniflow', 'hetlora_experts', 'flexlora_experts'} <= refusing
    cfg = {'fsplug': {'aggregation': {'robust': {'average': 'median'}}}}
    assert robust_problems(all_methods()['fedavg'], cfg) == []
    assert robust_problems(all_methods()['flame'], cfg)


# ------------------------------------------------------------------ the maths
def test_robust_averages_equal_their_naive_references():
    gen = torch.Generator().manual_seed(0)
    for count in (1, 2, 5, 6):
        rows = torch.randn(count, 3, 4, generator=gen, dtype=torch.float64)
        flat = rows.reshape(count, -1)
        assert torch.equal(coordinate_median(list(rows)).reshape(-1), naive_median(flat))
        for fraction in (0.0, 0.2, 0.34, 0.49):
            torch.testing.assert_close(trimmed_mean(list(rows), fraction).reshape(-1),
                                       naive_trimmed_mean(flat, fraction), rtol=0, atol=1e-12)


def test_weighted_average_follows_the_active_robust_average():
    states = [{'w': torch.tensor([float(v)])} for v in (1, 2, 3, 100)]
    assert float(weighted_average(states, [1, 1, 1, 1])['w']) == 26.5
    with robust_averaging(RobustAverage('median')):
        assert float(weighted_average(states, [1, 1, 1, 1])['w']) == 2.5
    with robust_averaging(RobustAverage('trimmed_mean', 0.25)):
        assert float(weighted_average(states, [1, 1, 1, 1])['w']) == 2.5
    assert float(weighted_average(states, [1, 1, 1, 1])['w']) == 26.5


def test_clip_update_scales_the_delta_only():
    sent = {'w': torch.full((4,), 10.0), 'b': torch.zeros(2)}
    update = {'w': torch.full((4,), 13.0), 'b': torch.zeros(2)}
    clipped, norm = clip_update(update, sent, 3.0)
    assert norm == 6.0
    assert torch.equal(clipped['w'], torch.full((4,), 11.5)) and torch.equal(clipped['b'], sent['b'])
    same, _ = clip_update(update, sent, 10.0)
    assert same is update


def test_results_rows_name_the_client_and_reason():
    server = server_of()
    honest_round(server, 0, lambda sent: ClientUpdate(ATTACKER, 8, {'w': sent['w'] * float('nan')},
                                                      dataset_size=SIZE))
    row = [r for r in server.results.rows if r['kind'] == 'rejected'][0]
    assert row == {'round': 0, 'client': ATTACKER, 'kind': 'rejected',
                   'reason': 'shared w (4,) has non-finite values (NaN/Inf)'}
    json.dumps(row)
