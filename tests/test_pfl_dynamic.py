"""PFL-Dynamic (issue 11, deliverable 6): tasks arrive one after another, batches come from an
episodic memory of what has arrived, evaluation covers the tasks started ('Self') and the
other clients' started tasks ('Others'), and the summary reports A_last and A_AUC."""
import pytest
from helpers import TINY_YAML, run_embedded_keeping_clients

from fs_plugins.data import stream
from fs_plugins.run.config import ConfigError, load_config


def test_stage_and_memory_schedule():
    # 6 rounds, 3 tasks: task s owns rounds [2s, 2s + 2); half of it arrives in each round
    assert [stream.stage(k, 6, 3) for k in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [stream.revealed([10, 10, 10], k, 6) for k in range(6)] == [5, 10, 15, 20, 25, 30]
    # uneven: 5 rounds, 2 tasks -> task 0 owns rounds 0-2, task 1 rounds 3-4
    assert [stream.revealed([9, 4], k, 5) for k in range(5)] == [3, 6, 9, 11, 13]
    record = {stream.TASK_RANK: 1, stream.TASK_COUNT: 3}
    assert [stream.visible(record, k, 6) for k in range(6)] == [False, False, True, True, True, True]


def test_task_order_and_annotation():
    splits = {'train': [{'t': 'b'}, {'t': 'a'}, {'t': 'c'}], 'test': [{'t': 'a'}]}
    assert stream.task_order(splits['train'], 't', 'sorted', 2) == ['a', 'b', 'c']
    assert stream.task_order(splits['train'], 't', 'rotated', 2) == ['b', 'c', 'a']
    annotated = stream.annotate(splits, 't', 'rotated', 2)
    assert [r[stream.TASK_RANK] for r in annotated['train']] == [0, 2, 1]
    assert annotated['test'][0] == {'t': 'a', stream.TASK_RANK: 2, stream.TASK_COUNT: 3,
                                    stream.OWNER: 2}
    assert 'task' not in splits['train'][0] and stream.TASK_RANK not in splits['train'][0]
    with pytest.raises(ValueError, match="task_field = 'u': client 2's records"):
        stream.annotate(splits, 'u', 'sorted', 2)


def test_memory_stream_draws_only_from_memory():
    data = list(range(10))
    memory = stream.MemoryStream(data, list, batch_size=4, seed=1, client_id=1)
    memory.set_memory(3)
    drawn = [memory.next() for _ in range(20)]
    assert all(len(b) == 3 and set(b) <= {0, 1, 2} for b in drawn)
    memory.set_memory(10)
    assert max(max(memory.next()) for _ in range(20)) >= 3
    again = stream.MemoryStream(data, list, 4, seed=1, client_id=1)
    again.set_memory(3)
    assert [again.next() for _ in range(20)] == drawn


def test_last_and_auc():
    assert stream.last_and_auc([0.2, 0.4, 0.9]) == (0.9, pytest.approx(0.5))


def _dynamic_cfg(tmp_path, rounds=4, *opts):
    return load_config(TINY_YAML, [
        'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
        'fsplug.results_dir', str(tmp_path / 'results'), 'data.splitter', 'iid',
        'federate.total_round_num', str(rounds), 'train.local_update_steps', '2',
        'fsplug.data.task_field', 'category', 'fsplug.data.dynamic', 'True',
        'fsplug.data.task_order', 'rotated', 'fsplug.data.evaluate_others', 'True', *opts])


@pytest.mark.slow
def test_dynamic_run_fills_memory_and_follows_the_tasks(tmp_path):
    cfg = _dynamic_cfg(tmp_path)
    results, clients = run_embedded_keeping_clients(cfg)
    client = clients[1]
    sizes = [client.memory_size(k) for k in range(4)]
    assert sizes == sorted(sizes) and sizes[-1] == len(client.train_data) and sizes[0] < sizes[-1]
    assert client.stream.size == sizes[-1]
    evals = sorted((r for r in results.rows if r['kind'] == 'eval' and r['client'] == 1),
                   key=lambda r: r['round'])
    # one new task each round (4 tasks, 4 rounds): the Self and Others sets grow
    assert [r['test_total'] for r in evals] == sorted(r['test_total'] for r in evals)
    assert evals[0]['test_total'] < evals[-1]['test_total'] == len(client.eval_data['test'])
    assert evals[0]['others_total'] < evals[-1]['others_total'] == len(client.eval_data['others'])
    assert len(client.eval_data['others']) == sum(len(c.eval_data['test'])
                                                  for cid, c in clients.items() if cid != 1)
    columns, table = results.final_rows()
    assert {'test_token_acc_auc', 'others_token_acc_auc'} <= set(columns)
    expected = sum(r['test_token_acc'] for r in evals) / len(evals)
    assert table[0]['test_token_acc_auc'] == pytest.approx(expected)


def test_dynamic_needs_a_task_field_and_enough_rounds(tmp_path):
    with pytest.raises(ConfigError, match='fsplug.data.dynamic = True: needs fsplug.data.task_field'):
        _dynamic_cfg(tmp_path, 4, 'fsplug.data.task_field', '')
    with pytest.raises(ValueError, match='total_round_num = 2 is fewer than the 4 tasks'):
        run_embedded_keeping_clients(_dynamic_cfg(tmp_path, 2))
