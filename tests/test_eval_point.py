"""fsplug.eval.point: 'received' evaluates each client after it loads the server's evaluation
content (FS-LLM's point), 'trained' its model as its last local training left it (the
FedMosaic authors' evaluation). Through FS: tests/test_fs_integration.py."""
import torch
from helpers import run_embedded_keeping_parties, tiny_config, write_yaml

from fs_plugins.run.config import load_config


def _run(tmp_path, point):
    cfg = load_config(write_yaml(tmp_path / f'{point}.yaml', tiny_config(
        tmp_path / point, 'fedavg', rounds=1, steps=2, fsplug={'eval': {'point': point}})))
    return run_embedded_keeping_parties(cfg)


def _lora(client):
    return {n: client.params[n].detach().clone() for n in client.trainable_names}


def test_trained_point_evaluates_the_local_models_received_the_global(tmp_path):
    results, clients, server = _run(tmp_path, 'trained')
    received, received_clients, received_server = _run(tmp_path, 'received')
    global_state = server.state['global']
    for client in clients.values():
        own = _lora(client)
        # FedAvg-LoRA after one round: each client still holds its own trained LoRA
        assert any(not torch.equal(own[n], global_state[n].to(own[n])) for n in own if n in global_state)
    for client in received_clients.values():   # each loaded FedAvg's global for evaluation
        assert all(torch.equal(v, global_n.to(v)) for n, v in _lora(client).items()
                   for global_n in [received_server.state['global'][n]])
    evals = {r['client']: r['test_avg_loss'] for r in results.rows if r['kind'] == 'eval'}
    evals_received = {r['client']: r['test_avg_loss'] for r in received.rows if r['kind'] == 'eval'}
    assert evals.keys() == evals_received.keys() and evals != evals_received
    # the same training: the train rows agree
    trains = [r['train_avg_loss'] for r in results.rows if r['kind'] == 'train']
    assert trains == [r['train_avg_loss'] for r in received.rows if r['kind'] == 'train']

