"""Using a run's fine-tuned model (issue 18): `fs-plugins predict` answers as the run's final
evaluation did, `fs-plugins eval` recomputes its metrics on a data file, `fs-plugins export`
writes Hugging Face folders (peft adapter, merged model) with the same logits, the global
state is a peft adapter folder, a client folder loads without the server's run_info.json
(a distributed client's results directory), and bad input ends in one line naming it."""
import json
import os
import shutil

import pytest
import torch
from helpers import deep_update, run_embedded_keeping_clients, tiny_config, write_yaml
from test_multimodal import vl_config

from fs_plugins import load_trained
from fs_plugins.commands.cli import main
from fs_plugins.run.artifacts import client_dir, global_dir
from fs_plugins.run.config import load_config


def _text_run(tmp_path, method='fedavg', **updates):
    cfg = tiny_config(tmp_path, method, rounds=1, steps=2, **deep_update(
        {'fsplug': {'eval': {'generate': True, 'max_new_tokens': 4, 'gen_metrics': ['rougeL']}}},
        updates))
    os.makedirs(tmp_path, exist_ok=True)
    return run_embedded_keeping_clients(load_config(write_yaml(tmp_path / 'run.yaml', cfg)))


def _write_records(path, records):
    with open(path, 'w') as handle:
        handle.writelines(json.dumps(r) + '\n' for r in records)
    return str(path)


def _read_jsonl(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def _batch(proc, n=4):
    data = proc.eval_data['test']
    batch = proc.collate([data[i] for i in range(min(n, len(data)))])
    batch.pop('labels')
    return batch


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['text', 'image'])
def test_predict_and_eval_reproduce_the_final_evaluation(tmp_path, kind):
    if kind == 'text':
        results, clients = _text_run(tmp_path)
        metric = 'rougeL'
    else:
        results, clients = run_embedded_keeping_clients(vl_config(tmp_path, 'tiny_llava')[0])
        metric = 'vqa_acc'
    run_dir, proc = results.out_dir, clients[1]
    questions = _write_records(tmp_path / 'questions.jsonl', proc.eval_data['test'].records)
    answers = str(tmp_path / 'answers.jsonl')
    assert main(['predict', '--run', run_dir, '--client', '1', '--input', questions,
                 '--output', answers, '--batch-size', '2']) == 0
    run_predictions = _read_jsonl(os.path.join(run_dir, 'predictions', 'client_1.jsonl'))
    assert [a['prediction'] for a in _read_jsonl(answers)] == \
        [p['prediction'] for p in run_predictions]
    metrics_path = str(tmp_path / 'metrics.json')
    assert main(['eval', '--run', run_dir, '--client', '1', '--data', questions,
                 '--output', metrics_path]) == 0
    with open(metrics_path) as handle:
        metrics = json.load(handle)
    final = [r for r in results.rows if r['kind'] == 'eval' and r['client'] == 1][-1]
    assert metrics['eval_avg_loss'] == pytest.approx(final['test_avg_loss'], rel=1e-6)
    assert metrics[f'eval_{metric}'] == pytest.approx(final[f'test_{metric}'])


@pytest.mark.slow
def test_global_state_is_a_peft_adapter_folder_and_exports(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fs_plugins.models.tiny import ensure_tiny_llama
    results, clients = _text_run(tmp_path)
    run_dir, batch = results.out_dir, _batch(clients[1])
    reloaded = load_trained(run_dir).model
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(None), dtype=torch.float32)
    from_peft = PeftModel.from_pretrained(base, global_dir(run_dir))
    torch.testing.assert_close(_logits(from_peft, batch), _logits(reloaded, batch))
    # export without --merge: a self-contained adapter folder (adapter + tokenizer)
    out = str(tmp_path / 'adapter_export')
    assert main(['export', '--run', run_dir, '--out', out]) == 0
    assert {'adapter_config.json', 'adapter_model.safetensors', 'tokenizer_config.json',
            'fsplug_export.json'} <= set(os.listdir(out))
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(None), dtype=torch.float32)
    torch.testing.assert_close(_logits(PeftModel.from_pretrained(base, out), batch),
                               _logits(reloaded, batch))
    # export --merge: a full model with the adapter model's logits (default folder)
    assert main(['export', '--run', run_dir, '--merge']) == 0
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, 'export', 'global_merged'),
                                                  dtype=torch.float32)
    torch.testing.assert_close(_logits(merged, batch), _logits(reloaded, batch),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_split_olmoe_experts_merge_back_into_transformers_layout(tmp_path):
    """LoRA on the split gate/up expert tensors (FLAME's placement) under FedAvg: the merged
    export has transformers' fused gate_up_proj and the adapter model's logits."""
    from transformers import AutoModelForCausalLM
    results, clients = _text_run(tmp_path, model={'type': 'tiny-olmoe@fsplug_llm'}, fsplug={
        'eval': {'generate': False, 'gen_metrics': []}, 'model': {'builder': 'tiny_olmoe', 'lora': {
            'target_modules': ['q_proj'], 'target_parameters': [
                'mlp.experts.gate_proj', 'mlp.experts.up_proj', 'mlp.experts.down_proj']}}})
    out = str(tmp_path / 'merged')
    assert main(['export', '--run', results.out_dir, '--client', '2', '--merge', '--out', out]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert any(n.endswith('experts.gate_up_proj') for n, _ in merged.named_parameters())
    batch = _batch(clients[2])
    torch.testing.assert_close(_logits(merged, batch), _logits(clients[2].model, batch),
                               rtol=1e-4, atol=1e-4)
    # without --merge the adapter targets tensors transformers' OLMoE does not have
    assert main(['export', '--run', results.out_dir, '--client', '2', '--out',
                 str(tmp_path / 'plain')]) == 2


@pytest.mark.slow
def test_a_client_folder_loads_without_the_servers_run_info(tmp_path):
    results, clients = _text_run(tmp_path, 'fedsa')
    alone = tmp_path / 'client_only'
    shutil.copytree(client_dir(results.out_dir, 3), client_dir(str(alone), 3))
    batch = _batch(clients[3])
    torch.testing.assert_close(_logits(load_trained(str(alone), client=3).model, batch),
                               _logits(clients[3].model, batch))


@pytest.mark.slow
def test_bad_input_ends_in_one_line_naming_it(tmp_path, capsys):
    results, _ = _text_run(tmp_path)
    run_dir = results.out_dir

    def fails(args, *fragments):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert 'Traceback' not in err
        for fragment in fragments:
            assert fragment in err, err
    fails(['predict', '--run', run_dir, '--input', str(tmp_path / 'none.jsonl')],
          'Input file not found', 'none.jsonl')
    bad = _write_records(tmp_path / 'bad.jsonl', [{'instruction': 'x'}, {'question': 'no'}])
    fails(['predict', '--run', run_dir, '--input', bad], 'record 1 (line 2)', 'bad.jsonl',
          "answers text records ('instruction'")
    fails(['eval', '--run', run_dir, '--data', bad], 'Record 0', 'lacks field(s)', 'output')
    fails(['predict', '--run', run_dir, '--client', '7', '--input', bad],
          'Client 7 is not a client of the run')
    fails(['export', '--run', str(tmp_path / 'nowhere'), '--merge'], 'Run directory not found')
    os.makedirs(tmp_path / 'full')
    open(tmp_path / 'full' / 'x', 'w').close()
    fails(['export', '--run', run_dir, '--merge', '--out', str(tmp_path / 'full')],
          'exists and is not empty')
    mole, _ = _text_run(tmp_path / 'mole', 'fedmole')
    fails(['export', '--run', mole.out_dir, '--client', '1', '--merge'],
          "method 'fedmole'", 'routed LoRA experts and routers')
