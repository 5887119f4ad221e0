"""The wiring audit (fs_plugins.run.audit): it sees what a method trains and sends, it catches
each kind of breach of a method's contract, and every shipped YAML passes it (on its tiny
variant: the same method, options and LoRA targets on a random-weight model of the same family).
The YAMLs come from the yamls/ tree and the methods from the registry: no hand-kept list."""
import json
import os

import pytest
from helpers import REPO, shipped_yamls, tiny_config, write_yaml

from fs_plugins.commands.audit import audit_yaml
from fs_plugins.methods.base import Contract, Phase
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run import audit as run_audit
from fs_plugins.run.audit import audit, format_report, group_of, tiny_client_variant, tiny_variant
from fs_plugins.run.config import load_config, read_yaml

SHIPPED = shipped_yamls()
CLIENT_FILES = [p for p in SHIPPED if all(str(k).startswith('client_') for k in read_yaml(os.path.join(REPO, p)))]


def _base_line(path: str) -> list[str]:
    with open(os.path.join(REPO, path), encoding='utf-8') as handle:
        for line in handle:
            if line.startswith('# base:'):
                return line[len('# base:'):].split('(')[0].split()
    raise AssertionError(f"{path}: per-client file without a '# base: <yaml>' line")


def audited_setups() -> list[tuple[str, str | None, list[str]]]:
    """(YAML, its client file or None, overrides): every shipped run YAML with each client file
    made for it, one per distinct tiny variant (distributed parties of one run audit as one)."""
    client_files: dict[str, list] = {}
    for path in CLIENT_FILES:
        base, *opts = _base_line(path)
        client_files.setdefault(base, []).append((path, opts))
    seen, setups = set(), []
    for path in SHIPPED:
        if path in CLIENT_FILES:
            continue
        variant = tiny_variant(read_yaml(os.path.join(REPO, path)))
        for key in ('outdir', 'expname'):
            variant.pop(key, None)
        variant.get('fsplug', {}).pop('results_dir', None)
        for client_file, opts in client_files.get(path, [(None, [])]):
            clients = read_yaml(os.path.join(REPO, client_file)) if client_file else None
            key = json.dumps([variant, opts, clients], sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                setups.append((path, client_file, opts))
    return setups


def _run_opts(tmp_path) -> list[str]:
    return ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp')]


@pytest.mark.slow
@pytest.mark.parametrize('path, client_file, opts', audited_setups(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_every_shipped_yaml_passes_the_audit(tmp_path, path, client_file, opts):
    report = audit_yaml(os.path.join(REPO, path), client_file and os.path.join(REPO, client_file),
                        opts + _run_opts(tmp_path), tiny=True)
    assert not report.problems, format_report(report)
    trains = get_method_class(report.method).trains   # zero_shot: nothing trains, nothing travels
    assert (report.totals['trainable_params'] > 0 and report.totals['local_flops'] > 0) == trains


def _tiny(tmp_path, method='fedavg'):
    return load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, method, rounds=1)))


def test_the_table_shows_what_fedavg_trains_sends_and_gets_back(tmp_path):
    report = audit(_tiny(tmp_path))
    assert not report.problems
    lora = [g for g in report.rows if 'lora_' in g.group]
    assert lora and len(lora) == len(report.rows)
    for g in lora:
        assert g.trainable_in == {'r0:train'} and g.grad_max > 0 and g.changed
        assert g.server == {'averaged'} and g.up_bytes == g.down_bytes > 0
    assert report.up_ratio == 1.0 and report.totals['up_bytes'] == report.fedavg['up_bytes']
    assert 'verdict: OK' in format_report(report)


def test_a_tensor_that_never_trains_but_travels_is_caught(tmp_path, monkeypatch):
    fedavg = get_method_class('fedavg')
    monkeypatch.setattr(fedavg, 'phases', lambda self, n, cfg: [Phase('B only', n, lambda name: 'lora_B' in name)])
    problems = audit(_tiny(tmp_path)).problems
    assert any('lora_A' in p and 'no gradient' in p for p in problems), problems
    assert any('lora_A' in p and 'not changed by local training' in p for p in problems), problems
    assert not any('lora_B' in p for p in problems), problems


def test_a_declared_local_tensor_leaving_the_client_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(get_method_class('fedavg'), 'contract', Contract(stays_local=('*lora_B*',)))
    problems = audit(_tiny(tmp_path)).problems
    assert problems and all('lora_B' in p and 'declared local' in p for p in problems), problems


def test_undeclared_and_missing_payloads_are_caught(tmp_path, monkeypatch):
    flora = get_method_class('flora')
    monkeypatch.setattr(flora, 'contract', Contract(uploads=('pq/*',), extra=('other.*',)))
    problems = audit(_tiny(tmp_path, 'flora')).problems
    assert any(p.startswith('pq/*: declared upload') for p in problems)
    assert any('scale/' in p and 'extra payload not declared' in p for p in problems)
    assert any(p.startswith('other.*: declared extra payload') for p in problems)


def test_an_unchanged_upload_the_contract_declares_is_accepted(tmp_path, monkeypatch):
    fedavg = get_method_class('fedavg')
    monkeypatch.setattr(fedavg, 'phases', lambda self, n, cfg: [Phase('B only', n, lambda name: 'lora_B' in name)])
    monkeypatch.setattr(fedavg, 'contract', Contract(unchanged_uploads=('*lora_A*',)))
    problems = audit(_tiny(tmp_path)).problems
    assert problems and all('no gradient' in p for p in problems)   # still: it never trains


def test_stages_are_all_audited(tmp_path):
    """FedLEASE's warm-up trains the LoRA only, later rounds the router too: both are run, and
    the router, idle in warm-up, is seen training afterwards."""
    cfg = load_config(os.path.join(REPO, 'yamls', 'fedlease', 'tiny.yaml'), _run_opts(tmp_path))
    report = audit(cfg)
    assert report.rounds == [0, 1], report.rounds
    assert not report.problems, format_report(report)
    routers = [g for g in report.rows if g.group.endswith('lease.router')]
    assert routers and all(g.trainable_in == {'r1:train'} and g.grad_max > 0 for g in routers)


def test_names_fold_layer_and_expert_indices():
    assert group_of('base_model.model.model.layers.11.mlp.experts.3.lora_A.default.weight') == \
        'model.layers.*.mlp.experts.*.lora_A.default.weight'
    assert group_of('pq/block2.self_attn.q_proj/P') == 'pq/block*.self_attn.q_proj/P'


def test_the_tiny_swap_caps_rank_bounded_options_and_thins_per_client_lists():
    """AdaLoRA's target_r with the capped rank; DoFIT's ten domain labels to the tiny
    federation's clients, evenly spaced (both domains kept); placeholders dropped."""
    plain = read_yaml(os.path.join(REPO, 'yamls', 'smartfed', 'paper_mgsm_fedit.yaml'))
    plain['fsplug'].update(method='adalora', adalora={'target_r': 32})
    plain['fsplug']['model']['lora']['r'] = 48
    assert tiny_variant(plain)['fsplug']['adalora']['target_r'] == 16
    plain['fsplug'].update(method='dofit', dofit={'domains': [0] * 5 + [1] * 5})
    swapped = tiny_variant(plain)
    assert swapped['fsplug']['dofit']['domains'] == [0, 0, 1, 1][:swapped['federate']['client_num']]
    library = read_yaml(os.path.join(REPO, 'yamls', 'smartfed', 'paper_mgsm.yaml'))
    config, _ = run_audit.tiny_config(library)
    assert '/path/to/' not in json.dumps(config)


def test_tiny_variants_keep_the_wiring_and_swap_the_model():
    plain = read_yaml(os.path.join(REPO, 'yamls', 'flame', 'alpagasus_flame.yaml'))
    variant = tiny_variant(plain)
    assert variant['fsplug']['model']['builder'] == 'tiny_olmoe'
    lora = plain['fsplug']['model']['lora']
    assert variant['fsplug']['model']['lora'] == {**lora, 'r': min(lora['r'], 16)}   # targets kept, rank capped
    assert variant['fsplug']['flame'] == plain['fsplug']['flame']
    assert variant['fsplug']['method'] == 'flame' and variant['data']['type'] == 'champ_math@fsplug'
    dense = tiny_variant(read_yaml(os.path.join(REPO, 'yamls', 'flame', 'alpagasus_dense_trivial.yaml')))
    assert dense['fsplug']['model']['builder'] == 'tiny_olmo'
    entry = tiny_client_variant({'model': {'type': 'big@fsplug_llm'}, 'fsplug': {'model': {'lora': {'r': 4}}}},
                                'tiny_llava')
    assert entry['model']['type'] == 'tiny-llava@fsplug_llm' and entry['fsplug']['model']['lora'] == {'r': 4}


def test_a_declared_trainable_tensor_that_does_not_exist_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(get_method_class('fedavg'), 'contract', Contract(trains=('*lora_A*', '*router*')))
    problems = audit(_tiny(tmp_path)).problems
    assert problems == ['*router*: declared to train (Contract.trains) but no trainable tensor matches '
                        '(client 1, 2)'], problems
