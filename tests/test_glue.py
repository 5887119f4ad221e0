"""GLUE harness (UniFLoW §4.2, Table 4): local GLUE files in their official layouts, label ids
from the task definition, the Dirichlet split into 3 clients, the tiny RoBERTa classifier
under every compared method (test_acc; the trained head stays on each client by default, as
Table 7 counts it, or is shared and averaged with fsplug.model.head: shared), file errors and
the grid's table."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO, run_embedded_keeping_clients

from fs_plugins.core.errors import ConfigError
from fs_plugins.data import glue
from fs_plugins.models.classifier import ClassificationCodec, is_task_head
from fs_plugins.run.config import load_config
from fs_plugins.run.runtime import build_federated_records

TINY = os.path.join(REPO, 'yamls', 'glue', 'tiny.yaml')
METHODS = ('fed_a2', 'fedavg', 'ffa', 'feddpa', 'fedsa')
MNLI_TRAIN = ('index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t'
              'sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n'
              '0\t1\t1n\tgov\t(a)\t(b)\t(A)\t(B)\tA man sleeps.\tA man rests.\tneutral\tneutral\n'
              '1\t2\t2c\tgov\t(a)\t(b)\t(A)\t(B)\tIt rains.\tIt is dry.\tcontradiction\tcontradiction\n'
              '2\t3\t3e\tgov\t(a)\t(b)\t(A)\t(B)\tCats purr.\tCats make sounds.\tentailment\tentailment\n')


def _source(tmp_path, spec: str) -> glue.GlueSource:
    return glue.parse_data_type(spec, str(tmp_path))


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as handle:
        handle.write(text)


def _tiny(tmp_path, method='fed_a2', rounds=2, *opts):
    return load_config(TINY, ['federate.total_round_num', str(rounds), 'train.local_update_steps', '2',
                              'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
                              'fsplug.results_dir', str(tmp_path / 'results'),
                              'fsplug.method', method, 'fsplug.fed_a2.fedavg_rounds', '1', *opts])


# ------------------------------------------------------------------ loading
def test_mnli_tsv_layout_maps_names_to_the_task_ids(tmp_path):
    folder = tmp_path / 'MNLI'
    _write(folder / 'train.tsv', MNLI_TRAIN)
    _write(folder / 'dev_matched.tsv', MNLI_TRAIN.replace('\tneutral\tneutral', '\tneutral\tentailment'))
    records = glue.load_glue(_source(tmp_path, 'glue:mnli'))
    train = [r for r in records if r['split'] == 'train']
    assert [r['label'] for r in train] == [1, 2, 0]   # entailment 0, neutral 1, contradiction 2
    assert train[0]['sentence1'] == 'A man sleeps.' and train[0]['sentence2'] == 'A man rests.'
    assert [r['label'] for r in records if r['split'] == 'test'] == [0, 2, 0]   # gold_label wins


def test_hf_column_names_and_jsonl_give_the_same_records(tmp_path):
    folder = tmp_path / 'mnli_hf'
    rows = [{'premise': 'A man sleeps.', 'hypothesis': 'A man rests.', 'label': 1},
            {'premise': 'It rains.', 'hypothesis': 'It is dry.', 'label': 'contradiction'}]
    for stem in ('train', 'validation_matched'):
        _write(folder / f'{stem}.jsonl', ''.join(json.dumps(r) + '\n' for r in rows))
    records = glue.load_glue(_source(tmp_path, 'glue:mnli:mnli_hf'))
    assert [(r['sentence1'], r['label'], r['split']) for r in records] == [
        ('A man sleeps.', 1, 'train'), ('It rains.', 2, 'train'),
        ('A man sleeps.', 1, 'test'), ('It rains.', 2, 'test')]


def test_parquet_and_saved_dataset_dict(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict
    rows = {'sentence': ['a fine film', 'dull'], 'label': [1, 0], 'idx': [0, 1]}
    os.makedirs(tmp_path / 'pq')
    for stem in ('train', 'validation'):
        pq.write_table(pa.table(rows), tmp_path / 'pq' / f'{stem}.parquet')
    DatasetDict({'train': Dataset.from_dict(rows), 'validation': Dataset.from_dict(rows)}
                ).save_to_disk(str(tmp_path / 'hf'))
    for folder in ('pq', 'hf'):
        records = glue.load_glue(_source(tmp_path, f'glue:sst2:{folder}'))
        assert [(r['sentence'], r['label'], r['split']) for r in records] == [
            ('a fine film', 1, 'train'), ('dull', 0, 'train'),
            ('a fine film', 1, 'test'), ('dull', 0, 'test')]


@pytest.mark.parametrize('task', sorted(glue.GLUE_TASKS))
def test_every_task_layout_loads_from_its_fixture(tmp_path, task):
    records = glue.load_glue(_source(tmp_path, f'glue_tiny:{task}'))
    definition = glue.GLUE_TASKS[task]
    assert {r['split'] for r in records} == {'train', 'test'}
    assert {r['label'] for r in records} == set(range(len(definition.labels)))
    assert all(set(definition.text_fields) <= set(r) for r in records)
    if task == 'sst2':
        assert definition.text_fields == ('sentence',) and len(definition.labels) == 2
    if task == 'mnli':
        assert os.path.isfile(tmp_path / 'glue_tiny' / 'MNLI' / 'dev_matched.tsv')
        assert len(definition.labels) == 3


def test_codec_label_ids_come_from_the_task_not_the_data():
    from fs_plugins.models.classifier import build_tokenizer
    codec = ClassificationCodec(build_tokenizer(), glue.GLUE_TASKS['mnli'].labels, 16)
    names = [codec.encode({'premise': 'a b', 'hypothesis': 'c', 'label': name})['labels'].item()
             for name in ('contradiction', 'entailment', 'neutral', '2', 0)]
    assert names == [2, 0, 1, 2, 0]
    long = codec.encode({'sentence': 'river ' * 50, 'label': 1})
    assert len(long['input_ids']) == 16     # truncated at llm.tok_len
    batch = codec.collate([long, codec.encode({'sentence': 'good', 'label': 0})])
    assert batch['input_ids'].shape == (2, 16) and batch['labels'].tolist() == [1, 0]
    with pytest.raises(ValueError, match="label 'maybe'"):
        codec.encode({'sentence': 'x', 'label': 'maybe'})


def test_dirichlet_split_over_labels_gives_three_clients(tmp_path):
    records = build_federated_records(_tiny(tmp_path))
    assert records.client_num == 3
    for splits in records.clients.values():
        assert splits['train'] and splits['test']
        assert {r['split'] for r in splits['test']} == {'test'}
    # label-skewed: the clients' label shares differ
    shares = [sum(r['label'] for r in s['train']) / len(s['train']) for s in records.clients.values()]
    assert max(shares) - min(shares) > 0.2


# ------------------------------------------------------------------- errors
def test_missing_folder_file_and_column_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match='SST-2'):
        glue.load_glue(_source(tmp_path, 'glue:sst2'))
    _write(tmp_path / 'SST-2' / 'train.tsv', 'sentence\tlabel\ngood film\t1\n')
    with pytest.raises(FileNotFoundError, match=r'no test file .*dev\.tsv'):
        glue.load_glue(_source(tmp_path, 'glue:sst2'))
    _write(tmp_path / 'SST-2' / 'dev.tsv', 'text\tlabel\ngood film\t1\n')
    with pytest.raises(ValueError, match=r"dev\.tsv: no column 'sentence'"):
        glue.load_glue(_source(tmp_path, 'glue:sst2'))
    _write(tmp_path / 'SST-2' / 'dev.tsv', 'sentence\tlabel\ngood film\t7\n')
    with pytest.raises(ValueError, match=r"dev\.tsv, record 0: label '7'"):
        glue.load_glue(_source(tmp_path, 'glue:sst2'))
    with pytest.raises(ConfigError, match="unknown GLUE task 'cola'"):
        _source(tmp_path, 'glue:cola')


def test_classifier_builder_needs_a_glue_task(tmp_path):
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    cfg = _tiny(tmp_path, 'fedavg', 2, 'data.type', 'tiny_tasks@fsplug')
    with pytest.raises(ConfigError, match="data.type = 'glue:<task>"):
        build_model(cfg, get_method_class('fedavg')(cfg))


# --------------------------------------------------------------- federated runs
def _spy_updates(monkeypatch):
    """The updates every ServerProcedure.aggregate of the run receives, in order."""
    from fs_plugins.run.server import ServerProcedure
    captured = []
    original = ServerProcedure.aggregate

    def spy(self, round_idx, updates):
        captured.append(list(updates))
        return original(self, round_idx, updates)
    monkeypatch.setattr(ServerProcedure, 'aggregate', spy)
    return captured


@pytest.mark.slow
@pytest.mark.parametrize('method', METHODS)
def test_tiny_yaml_runs_and_keeps_the_head_local(tmp_path, monkeypatch, method):
    """Default fsplug.model.head local: the head trains on every client but is never uploaded,
    so the clients' heads differ after training; the server's global state holds none, and
    each client's evaluation is its own model's, head included."""
    from fs_plugins.run.evaluation import token_metrics
    captured = _spy_updates(monkeypatch)
    cfg = _tiny(tmp_path, method)
    assert cfg.fsplug.model.head == 'local'
    results, clients = run_embedded_keeping_clients(cfg)
    evals = [r for r in results.rows if r['kind'] == 'eval']
    assert len(evals) == 2 * 3 and all(0 <= r['test_acc'] <= 1 for r in evals)
    assert all(math.isfinite(r['test_avg_loss']) and 'test_token_acc' not in r for r in evals)
    heads = {cid: {n: p.detach().clone() for n, p in proc.model.named_parameters() if is_task_head(n)}
             for cid, proc in clients.items()}
    first = next(iter(clients.values()))
    assert heads[1] and set(heads[1]) <= set(first.trainable_names)
    assert not any(first.method.is_shared(n) for n in heads[1])
    assert len(captured) == 2
    for updates in captured:
        for u in updates:
            assert u.shared and not any(is_task_head(n) for n in u.shared)
            # what is uploaded is the method's adapter tensors only
            assert all('lora_' in n or 'vera_lambda' in n for n in u.shared), sorted(u.shared)
    for cid in (2, 3):     # each client trained its own head
        assert any(not torch.equal(heads[1][n], heads[cid][n]) for n in heads[1])
    for cid, proc in clients.items():   # the logged evaluation is the client's model (own head)
        reported = [r for r in evals if r['client'] == cid][-1]
        proc.model.eval()
        again = token_metrics(proc.model, proc.eval_data['test'], proc.collate, 8, 'test')
        assert again == pytest.approx({k: reported[k] for k in ('test_avg_loss', 'test_acc', 'test_total')})


def test_local_head_persists_across_rounds_and_is_not_in_the_global_state(tmp_path, monkeypatch):
    """Round 2 starts from the head each client trained in round 1 (receive loads only the
    global adapters), and the server's state never holds a head."""
    from fs_plugins.run.server import ServerProcedure
    states = []
    original = ServerProcedure.aggregate

    def spy(self, round_idx, updates):
        out = original(self, round_idx, updates)
        states.append(self.state['global'])
        return out
    monkeypatch.setattr(ServerProcedure, 'aggregate', spy)
    captured = _spy_updates(monkeypatch)
    _, clients = run_embedded_keeping_clients(_tiny(tmp_path, 'fedavg', 2))
    assert states and all(not any(is_task_head(n) for n in s) for s in states)
    # the global state is exactly the average of the uploads: LoRA factors only
    assert set(states[-1]) == set(captured[-1][0].shared)
    head = [n for n in clients[1].trainable_names if is_task_head(n)]
    assert head


def test_shared_head_is_uploaded_and_is_the_weighted_average(tmp_path, monkeypatch):
    """fsplug.model.head shared (FedSA: its is_shared asks is_task_head): the head is sent
    and every client ends with the weighted average of the trained heads."""
    from fs_plugins.methods.base import weights_of
    captured = _spy_updates(monkeypatch)
    _, clients = run_embedded_keeping_clients(_tiny(tmp_path, 'fedsa', 1, 'fsplug.model.head', 'shared'))
    updates = captured[-1]
    head = [n for n in updates[0].shared if is_task_head(n)]
    assert head and all(n in u.shared for u in updates for n in head)
    assert not any('lora_B' in n for n in updates[0].shared)              # FedSA: B stays local
    weights = torch.tensor(weights_of(updates)) / sum(weights_of(updates))
    for proc in clients.values():
        assert all(proc.method.is_shared(n) for n in head)
        for name in head:
            expected = sum(w * u.shared[name] for w, u in zip(weights, updates))
            assert torch.allclose(proc.params[name].detach(), expected, atol=1e-6)
    assert not torch.equal(updates[0].shared[head[0]], updates[1].shared[head[0]])   # trained


@pytest.mark.slow
@pytest.mark.parametrize('method', METHODS)
def test_shared_head_runs_with_every_method(tmp_path, monkeypatch, method):
    captured = _spy_updates(monkeypatch)
    _, clients = run_embedded_keeping_clients(_tiny(tmp_path, method, 1, 'fsplug.model.head', 'shared'))
    heads = [{n: p for n, p in proc.model.named_parameters() if is_task_head(n)} for proc in clients.values()]
    assert all(any(is_task_head(n) for n in u.shared) for u in captured[-1])
    assert all(torch.equal(heads[0][n], other[n]) for other in heads[1:] for n in heads[0])


def test_head_option_is_checked_and_only_concerns_classifiers(tmp_path):
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.models.classifier import CLASSIFIER_BUILDERS, head_stays_local
    assert {'roberta_classifier', 'tiny_roberta_classifier'} <= CLASSIFIER_BUILDERS
    with pytest.raises(ConfigError, match='fsplug.model.head'):
        _tiny(tmp_path, 'fedavg', 1, 'fsplug.model.head', 'global')
    assert head_stays_local('tiny_roberta_classifier', 'local')
    assert not head_stays_local('tiny_roberta_classifier', 'shared')
    assert not head_stays_local('tiny_llama', 'local')     # no task head: nothing to keep
    llm = load_config(os.path.join(REPO, 'yamls', 'fedavg', 'tiny.yaml'))
    method = get_method_class('fedavg')(llm)
    assert method.is_shared('base_model.model.score.weight')   # a causal LM: untouched


@pytest.mark.parametrize('method,sent', [('fedavg', 786_432), ('fed_a2', 786_432),
                                         ('ffa', 393_216), ('fedsa', 393_216), ('feddpa', 786_432)])
def test_roberta_large_counts_are_table_7s(method, sent):
    """UniFLoW Table 7 (RoBERTa-large, LoRA r = 8 on query/value): trainable 1.83M (FFA 1.44M,
    FedDPA 2.62M), communicated 0.78M (FFA and FedSA 0.39M): the LoRA factors alone, the head
    (1,051,650 parameters) trains but stays on the client. Built on the meta device."""
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.models.builders import architecture_only
    cfg = load_config(os.path.join(REPO, 'yamls', 'glue', 'rte.yaml'),
                      ['model.type', 'FacebookAI/roberta-large@fsplug_llm', 'fsplug.method', method])
    m = get_method_class(method)(cfg)
    with architecture_only(device='meta'):
        built = build_model(cfg, m, share_frozen=False)
    params = dict(built.model.named_parameters())
    head = sum(params[n].numel() for n in built.trainable_names if is_task_head(n))
    trainable = sum(params[n].numel() for n in built.trainable_names)
    uploaded = sum(params[n].numel() for n in built.trainable_names if m.is_shared(n))
    assert head == 1024 * 1024 + 1024 + 1024 * 2 + 2 == 1_051_650
    assert uploaded == sent
    lora = 24 * 2 * 2 * 8 * 1024                                      # 786,432
    paper_trainable = {'fedavg': 1.83e6, 'fed_a2': 1.83e6, 'fedsa': 1.83e6, 'ffa': 1.44e6,
                       'feddpa': 2.62e6}[method]
    assert trainable == head + (2 * lora if method == 'feddpa' else lora // 2 if method == 'ffa' else lora)
    assert abs(trainable - paper_trainable) < 0.01e6                  # the table's 2 decimals
    shared = get_method_class(method)(load_config(
        os.path.join(REPO, 'yamls', 'glue', 'rte.yaml'),
        ['model.type', 'FacebookAI/roberta-large@fsplug_llm', 'fsplug.method', method,
         'fsplug.model.head', 'shared']))
    assert sum(params[n].numel() for n in built.trainable_names if shared.is_shared(n)) == sent + head


@pytest.mark.parametrize('opts', [['fsplug.model.lora.use_rslora', 'True'],
                                  ['fsplug.model.adapter', 'vera'],
                                  ['fsplug.model.dtype', 'bfloat16']])
def test_rslora_vera_and_half_precision_variants(tmp_path, opts):
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    cfg = _tiny(tmp_path, 'fedavg', 2, *opts)
    built = build_model(cfg, get_method_class('fedavg')(cfg))
    head = [n for n in built.trainable_names if is_task_head(n)]
    adapters = [n for n in built.trainable_names if not is_task_head(n)]
    assert head and adapters and all(('vera_lambda' in n) == (opts[-1] == 'vera') for n in adapters)
    params = dict(built.model.named_parameters())
    assert {params[n].dtype for n in built.trainable_names} == {torch.float32}
    batch = built.codec.collate([built.codec.encode({'sentence': 'good warm', 'label': 1})])
    assert torch.isfinite(built.model(**batch).loss)


def test_saved_client_model_reloads_with_its_head(tmp_path):
    import fs_plugins
    from fs_plugins.models.codecs import EncodedDataset
    from fs_plugins.run.evaluation import token_metrics
    cfg = _tiny(tmp_path, 'fedsa', 1)
    results, clients = run_embedded_keeping_clients(cfg)
    reported = [r for r in results.rows if r['kind'] == 'eval' and r['client'] == 3][-1]
    built = fs_plugins.load_trained(str(tmp_path / 'results'), client=3)
    built.model.eval()
    test = EncodedDataset(clients[3].eval_data['test'].records, built.codec, 'client 3 test')
    again = token_metrics(built.model, test, built.codec.collate, 8, 'test')
    assert again == pytest.approx({k: reported[k] for k in ('test_avg_loss', 'test_acc', 'test_total')})


# --------------------------------------------------------------------- grid
@pytest.mark.slow
def test_grid_dry_run_and_table(tmp_path):
    script = os.path.join(REPO, 'scripts', 'run_glue_grid.py')
    out = subprocess.run([sys.executable, script, 'run', '--dry-run', '--tasks', 'rte', '--seeds', '1',
                          '--methods', 'fedsa', '--out', str(tmp_path), '--', 'data.root', '/d/{task}'],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 3 and all('fsplug.method fedsa' in line and '/d/rte' in line for line in out)
    assert 'use_rslora True' in out[1] and 'fsplug.model.adapter vera' in out[2]
    for seed, accs in ((1, (0.5, 1.0)), (2, (1.0, 1.0))):
        run_dir = tmp_path / 'rte' / 'lora' / 'fed_a2' / f'seed{seed}'
        rows = [{'kind': 'eval', 'round': 0, 'client': c + 1, 'test_acc': a, 'test_total': 10 * (c + 1)}
                for c, a in enumerate(accs)]
        _write(run_dir / 'results.jsonl', ''.join(json.dumps(r) + '\n' for r in rows))
    table = subprocess.run([sys.executable, script, 'table', '--out', str(tmp_path)],
                           capture_output=True, text=True, check=True).stdout
    # seed 1 pooled: (0.5·10 + 1·20) / 30 = 83.33; seed 2: 100 -> 91.67 ± 11.79
    assert '| LoRA | FedA²-LoRA | 91.67 ± 11.79 (n=2) | 91.67 |' in table
    curves = subprocess.run([sys.executable, script, 'curves', '--out', str(tmp_path)],
                            capture_output=True, text=True, check=True).stdout
    assert '| round | rte/lora/fed_a2 |' in curves and '| 1 | 91.67 (n=2) |' in curves
