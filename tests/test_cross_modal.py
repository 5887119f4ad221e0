"""Cross-modal evaluation (UniFLoW Tables 1-3): clients of one modality tested on every
modality (fsplug.data.test_records: all), each test modality scored apart
(test_<modality>_<metric>), and the summary in the paper's layout; on yamls/uniflow/tiny.yaml
(tiny_media: groups image, audio, both)."""
import math

import pytest
from helpers import REPO, run_embedded_keeping_clients

from fs_plugins.core.errors import ConfigError
from fs_plugins.data.federated import pool_test_records
from fs_plugins.run.config import load_config
from fs_plugins.run.evaluation import modality_groups, token_metrics
from fs_plugins.run.runtime import build_federated_records

TINY = f'{REPO}/yamls/uniflow/tiny.yaml'
IMAGE_ONLY = ['fsplug.data.select', "['image']", 'fsplug.data.test_records', 'all',
              'federate.client_num', '1', 'federate.sample_client_num', '1']


def tiny_cfg(tmp_path, *overrides):
    return load_config(TINY, ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
                              'fsplug.results_dir', str(tmp_path / 'results'), *overrides])


def test_a_left_out_group_trains_no_client_but_tests_every_client(tmp_path):
    """Without a 'split' field in the records, a group left out by `select` gives all its
    records to the test set; the image client keeps its own train / test split."""
    own = build_federated_records(tiny_cfg(tmp_path))
    pooled = build_federated_records(tiny_cfg(tmp_path, *IMAGE_ONLY))
    assert list(pooled.client_names.values()) == ['image']
    image = pooled.clients[1]
    test_groups = [r['client_group'] for r in image['test']]
    every = {cid: own.clients[cid]['train'] + own.clients[cid]['test'] for cid in own.clients}
    assert test_groups.count('audio') == len(every[1]) and test_groups.count('both') == len(every[2])
    own_image = sorted(r['id'] for r in image['train'] + image['test'] if r['client_group'] == 'image')
    assert own_image == sorted(r['id'] for r in every[3])
    assert {r['client_group'] for r in image['train']} == {'image'}


def test_pooled_test_records_are_every_clients_plus_the_left_out_ones():
    clients = {1: {'train': [{'id': 'a'}], 'test': [{'id': 't1'}]},
               2: {'train': [{'id': 'b'}], 'test': [{'id': 't2'}]}}
    pool_test_records(clients, [{'id': 'x'}])
    assert [r['id'] for r in clients[1]['test']] == ['t1', 't2', 'x']
    assert clients[1]['test'] is clients[2]['test']
    assert [r['id'] for r in clients[2]['train']] == ['b']


@pytest.mark.parametrize('other', ['evaluate_others', 'dynamic'])
def test_pooled_tests_refuse_per_client_test_options(tmp_path, other):
    extra = ['fsplug.data.task_field', 'task'] if other == 'dynamic' else []
    with pytest.raises(ConfigError, match="test_records = 'all'"):
        tiny_cfg(tmp_path, 'fsplug.data.test_records', 'all', f'fsplug.data.{other}', 'True',
                 *extra)


@pytest.mark.slow
def test_image_only_clients_are_scored_per_test_modality(tmp_path):
    """Table 1's setting: the one image client trains, is tested on image, audio and image +
    audio records, each scored apart; the whole set's token metrics are their sums."""
    cfg = tiny_cfg(tmp_path, *IMAGE_ONLY, 'federate.total_round_num', '1',
                   'train.local_update_steps', '4', 'fsplug.eval.generate', 'True',
                   'fsplug.eval.max_new_tokens', '2', 'fsplug.eval.max_gen_samples', '2',
                   'fsplug.eval.gen_metrics', "['vqa_exact']")
    results, clients = run_embedded_keeping_clients(cfg)
    client = clients[1]
    assert client.cfg.fsplug.uniflow.client_modalities == ['image']
    row = [r for r in results.rows if r['kind'] == 'eval'][-1]
    labels = ('image', 'audio', 'image+audio')
    assert sum(row[f'test_{m}_total'] for m in labels) == row['test_total']
    # max_gen_samples caps each test modality: every one gets answers
    assert all(f'test_{m}_vqa_exact' in row for m in labels) and 'test_vqa_exact' in row
    with open(client.predictions_path) as handle:
        assert len(handle.readlines()) == 2 * len(labels)
    dataset = client.eval_data['test']
    groups = modality_groups(dataset)
    assert sorted(groups) == sorted(labels)
    for label in labels:   # the same numbers as scoring that part alone
        alone = token_metrics(client.model, dataset.subset_at(groups[label]), client.collate,
                              4, 'x')
        assert math.isclose(alone['x_token_acc'], row[f'test_{label}_token_acc'])
        assert math.isclose(alone['x_avg_loss'], row[f'test_{label}_avg_loss'], rel_tol=1e-6)
    summary = results.summary_markdown()
    assert 'By test modality' in summary
    header = summary.split('By test modality')[1].splitlines()[1]
    assert header.startswith('| method |')
    for label in labels:
        assert f'{label} token_acc' in header and f'{label} vqa_exact' in header
    assert 'total' not in header
    assert header.index('| image token_acc') < header.index('| audio token_acc') < \
        header.index('| image+audio token_acc')   # single modalities first, encoders' order
    assert header.index('image token_acc') < header.index('image vqa_exact') < \
        header.index('image avg_loss')   # the paper's order: Acc, generation metrics, loss


@pytest.mark.slow
def test_a_text_model_has_no_modality_columns(tmp_path):
    from helpers import tiny_config, write_yaml

    from fs_plugins.sim.runner import run_embedded
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, rounds=1, steps=1)))
    results = run_embedded(cfg)
    assert 'By test modality' not in results.summary_markdown()
    assert not [k for r in results.rows for k in r if k.startswith('test_text_')]

