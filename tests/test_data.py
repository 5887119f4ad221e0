import json
from collections import Counter

import numpy as np
import pytest

from fs_plugins.data import splitters
from fs_plugins.data.batches import BatchStream, local_steps
from fs_plugins.data.builtin import tiny_tasks_records
from fs_plugins.data.instruction import IGNORE_INDEX, format_prompt, load_records, tokenize_record
from fs_plugins.run.config import Cfg, ConfigError


def _records(n_per=30):
    return tiny_tasks_records(per_category=n_per, seed=0)


def test_iid_partition_covers_everything_once():
    parts = splitters.split('iid', _records(), 3, seed=1)
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(120)) and [len(p) for p in parts] == [40, 40, 40]


def test_dirichlet_seeded_min_size_and_skew():
    recs = _records(50)
    a = splitters.split('dirichlet', recs, 4, seed=3, field='category', alpha=0.1, min_size=5)
    b = splitters.split('lda', recs, 4, seed=3, field='category', alpha=0.1, min_size=5)
    assert a == b                                     # seeded; lda is an alias
    assert min(len(p) for p in a) >= 5
    assert sorted(i for p in a for i in p) == list(range(200))
    # alpha = 0.1 concentrates each client on few categories
    top_share = [max(Counter(recs[i]['category'] for i in p).values()) / len(p) for p in a]
    assert np.mean(top_share) > 0.6
    assert a != splitters.split('dirichlet', recs, 4, seed=4, field='category', alpha=0.1, min_size=5)


def test_dirichlet_impossible_min_size_is_explained():
    with pytest.raises(ConfigError, match='min_client_size'):
        splitters.split('dirichlet', _records(2), 4, seed=0, field='category', alpha=0.5, min_size=50)


def test_by_source_one_client_per_value():
    recs = _records(10)
    parts = splitters.split('by_source', recs, 4, seed=0, field='category')
    assert [recs[p[0]]['category'] for p in parts] == ['arith', 'count', 'reverse', 'upper']
    assert all(len({recs[i]['category'] for i in p}) == 1 for p in parts)
    with pytest.raises(ConfigError, match='client_num = 3'):
        splitters.split('by_source', recs, 3, seed=0, field='category')
    with pytest.raises(ConfigError, match="'source'"):
        splitters.split('by_source', recs, 4, seed=0, field='source')


def test_load_records_json_and_jsonl(tmp_path):
    recs = [{'instruction': 'i', 'input': '', 'output': 'o', 'category': 'c'}]
    (tmp_path / 'a.json').write_text(json.dumps(recs))
    (tmp_path / 'a.jsonl').write_text('\n'.join(json.dumps(r) for r in recs))
    assert load_records(str(tmp_path / 'a.json')) == load_records(str(tmp_path / 'a.jsonl')) == recs
    with pytest.raises(FileNotFoundError, match='missing.jsonl'):
        load_records(str(tmp_path / 'missing.jsonl'))
    (tmp_path / 'bad.jsonl').write_text(json.dumps({'instruction': 'x'}))
    with pytest.raises(ValueError, match="Record 0 .*output"):
        load_records(str(tmp_path / 'bad.jsonl'))


def test_prompt_templates():
    rec = {'instruction': 'Add.', 'input': '1 2', 'output': '3'}
    assert '### Input:\n1 2' in format_prompt(rec, 'alpaca')
    assert '### Input' not in format_prompt({**rec, 'input': ''}, 'alpaca')
    assert format_prompt(rec, 'plain') == 'Add.\n1 2\n'


def test_loss_only_on_answer_tokens():
    from transformers import AutoTokenizer

    from fs_plugins.models.tiny import ensure_tiny_llama
    tok = AutoTokenizer.from_pretrained(ensure_tiny_llama())
    rec = {'instruction': 'Add the two numbers.', 'input': '1 2', 'output': '3'}
    ex = tokenize_record(rec, tok, 'plain', 64)
    n_prompt = len(tok(format_prompt(rec, 'plain'))['input_ids'])
    assert (ex['labels'][:n_prompt] == IGNORE_INDEX).all()
    assert (ex['labels'][n_prompt:] == ex['input_ids'][n_prompt:]).all()
    assert ex['input_ids'][-1] == tok.eos_token_id
    assert tokenize_record(rec, tok, 'plain', n_prompt) is None   # no answer token fits


def test_batch_stream_is_deterministic_and_covers_epochs():
    data = list(range(10))
    collate = lambda xs: xs  # noqa: E731
    a, b = BatchStream(data, collate, 4, seed=5, client_id=1), BatchStream(data, collate, 4, seed=5, client_id=1)
    seq_a = [a.next() for _ in range(6)]
    assert seq_a == [b.next() for _ in range(6)]
    assert sorted(sum(seq_a[:3], [])) == data               # epoch 0 = a permutation
    assert sorted(sum(seq_a[3:6], [])) == data              # epoch 1 = another permutation
    other = BatchStream(data, collate, 4, seed=5, client_id=2)
    assert [other.next() for _ in range(3)] != seq_a[:3]


def test_local_steps_follow_fs_meaning():
    assert local_steps(Cfg.wrap({'batch_or_epoch': 'batch', 'local_update_steps': 7}), 100, 8) == 7
    assert local_steps(Cfg.wrap({'batch_or_epoch': 'epoch', 'local_update_steps': 2}), 100, 8) == 26
