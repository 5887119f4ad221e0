"""FedMosaic's comparisons with Nash-MTL's weights (Table 33 'FedMosaic w/ NBS') and with a W_s
of another tokenizer (A.20, Table 31's LLaVA-Qwen-0.5B for Llama clients): the bargaining maths
against a generic solver and a 2-task closed form, W_s's own batches against encoding the
records directly, and both run end to end on the tiny heterogeneous federation."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import REPO, run_embedded_keeping_clients
from scipy.optimize import minimize

from fs_plugins.aggregation.mosaic import rela_weights
from fs_plugins.aggregation.nash import nash_bargaining_alpha, nash_weights
from fs_plugins.methods.building import build_model
from fs_plugins.methods.fedmosaic import (
    GRAD_KEY,
    FedMosaic,
    client_train_records,
    is_pq_name,
    nbs_weight_rows,
    same_tokenizer,
    small_base,
)
from fs_plugins.models.tiny import TINY_CONFIG, build_tokenizer
from fs_plugins.run.config import ConfigError, client_config, load_config, read_yaml
from fs_plugins.tuners.mosaic.ws_batches import RecordIndex

TINY = os.path.join(REPO, 'yamls', 'fedmosaic', 'tiny.yaml')
CLIENTS = os.path.join(REPO, 'yamls', 'fedmosaic', 'tiny_clients.yaml')


def _cfg(tmp_path, *opts):
    return load_config(TINY, ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
                              'fsplug.results_dir', str(tmp_path / 'results'),
                              'fsplug.fedmosaic.alignment_dir', str(tmp_path / 'align'), *opts])


# ------------------------------------------------------------------ Nash bargaining (maths)
def _normalised_gram(g):
    gram = g.double() @ g.double().T
    return gram / gram.norm()


@pytest.mark.parametrize('shape', [(2, 5), (4, 10), (6, 40)])
def test_nash_alpha_is_the_fixed_point_and_the_generic_minimiser(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    alpha = nash_bargaining_alpha(g, ridge=0.0)
    gram = _normalised_gram(g)
    torch.testing.assert_close(gram @ alpha * alpha, torch.ones(shape[0], dtype=torch.float64),
                               rtol=0, atol=1e-8)
    m = gram.numpy()
    naive = minimize(lambda a: 0.5 * a @ m @ a - np.log(a).sum(), np.ones(shape[0]),
                     jac=lambda a: m @ a - 1 / a, bounds=[(1e-9, None)] * shape[0],
                     method='L-BFGS-B', options={'ftol': 1e-15, 'gtol': 1e-12})
    np.testing.assert_allclose(alpha.numpy(), naive.x, rtol=1e-4)


def test_two_task_weights_match_the_closed_form():
    """K = 2: a α1² = b α2² at the fixed point, so w_1 = ‖g_2‖ / (‖g_1‖ + ‖g_2‖) whatever the
    angle, and α1 = 1 / √(a + c √(a / b)) (M = [[a, c], [c, b]])."""
    g = torch.tensor([[3.0, 0.5, -1.0], [0.2, 1.0, 0.4]])
    n1, n2 = g.norm(dim=1).tolist()
    torch.testing.assert_close(nash_weights(g), torch.tensor([n2 / (n1 + n2), n1 / (n1 + n2)]))
    (a, c), (_, b) = _normalised_gram(g).tolist()
    alpha = nash_bargaining_alpha(g, ridge=0.0)
    assert float(alpha[0]) == pytest.approx(1 / (a + c * (a / b) ** 0.5) ** 0.5, rel=1e-9)


def test_nash_weights_edge_cases():
    g = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(nash_weights(1e-4 * g), nash_weights(g))       # scale-free
    with_zero = torch.cat([g, torch.zeros(1, 8)])
    weights = nash_weights(with_zero)
    assert float(weights[3]) == 0 and float(weights.sum()) == pytest.approx(1.0)
    torch.testing.assert_close(weights[:3], nash_weights(g))
    torch.testing.assert_close(nash_weights(torch.stack([g[0], -g[0]])), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(nash_weights(torch.zeros(2, 4)), torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match='task_vectors must be'):
        nash_weights(torch.ones(4))
    with pytest.raises(ValueError, match='non-finite'):
        nash_weights(torch.tensor([[1.0, float('nan')]]))


def test_nbs_rows_weigh_the_pq_task_vectors():
    initial = {'pq/block1.q/P': torch.eye(2), 'pq/block1.q/Q': torch.zeros(2)}
    gen = torch.Generator().manual_seed(0)
    locals_ = [{name: value + torch.randn(value.shape, generator=gen) for name, value in initial.items()}
               | {'x.lora_A.default.weight': torch.ones(1)} for _ in range(3)]
    rows = nbs_weight_rows(locals_, initial)
    vectors = torch.stack([torch.cat([(m['pq/block1.q/P'] - torch.eye(2)).flatten(), m['pq/block1.q/Q']])
                           for m in locals_])
    expected = nash_weights(vectors)
    assert rows.shape == (3, 3)
    for row in rows:
        torch.testing.assert_close(row, expected)
    with pytest.raises(ValueError, match='upload 0 has no'):
        nbs_weight_rows([{}], initial)


# ------------------------------------------------------------------ NBS in the federation
def test_nbs_needs_rela_and_pq_lora(tmp_path):
    with pytest.raises(ConfigError, match="aggregation = 'nbs'"):
        _cfg(tmp_path, 'fsplug.fedmosaic.aggregation', 'nbs', 'fsplug.fedmosaic.rela', 'False')


@pytest.mark.slow
def test_nbs_runs_end_to_end_with_one_global(tmp_path):
    cfg = _cfg(tmp_path, 'federate.total_round_num', '2', 'train.local_update_steps', '2',
               'fsplug.fedmosaic.aggregation', 'nbs', 'fsplug.fedmosaic.alignment_samples', '8')
    results, clients = run_embedded_keeping_clients(cfg, read_yaml(CLIENTS))
    evals = [r for r in results.rows if r['kind'] == 'eval']
    assert evals and all(r['test_avg_loss'] == r['test_avg_loss'] for r in evals)
    uploads, received = {}, {}
    for cid, proc in clients.items():
        assert GRAD_KEY not in proc.method.client_extra(proc.model, proc.state)   # no W_s gradient
        uploads[cid] = {n: v for n, v in proc.method.shared_tensors(proc.model, proc.trainable_names).items()
                        if is_pq_name(n)}
        modules = dict(proc.model.named_modules())
        received[cid] = {f'pq/{key}/{leaf}': getattr(modules[path].mosaic, f'global_{leaf}')
                         for path, key in proc.model.fedmosaic_pq.items() for leaf in ('P', 'Q')}
    # the last round's global is Σ w_i L_i, w = Nash-MTL's over the uploads' task vectors (the
    # clients' locals are still what they uploaded; P starts at I, Q at 0)
    ids = sorted(uploads)
    initial = {n: torch.eye(v.shape[0]) if n.endswith('/P') else torch.zeros_like(v)
               for n, v in uploads[1].items()}
    weights = nbs_weight_rows([uploads[c] for c in ids], initial)[0]
    assert not torch.allclose(weights, torch.full((4,), 0.25))
    for name in initial:
        expected = sum(w * uploads[c][name] for w, c in zip(weights.tolist(), ids))
        for cid in ids:     # one global for every client, across model types
            torch.testing.assert_close(received[cid][name], expected, msg=f'client {cid} {name}')


# ------------------------------------------------------------------ W_s with another tokenizer
def _other_vocab_llama(path) -> str:
    """A tiny Llama whose tokenizer has 300 entries (the run's tiny models: 400)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if not os.path.exists(path):
        tokenizer = build_tokenizer(vocab_size=300)
        config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             tie_word_embeddings=False, **TINY_CONFIG)
        torch.manual_seed(7)
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


def _other_ws_cfg(tmp_path, *opts):
    return _cfg(tmp_path, 'fsplug.fedmosaic.small_builder', 'causal_lm',
                'fsplug.fedmosaic.small_model_type', f'{_other_vocab_llama(tmp_path / "ws")}@fsplug_llm',
                *opts)


def test_ws_with_another_tokenizer_reads_the_batch_records_in_its_own_ids(tmp_path):
    cfg = _other_ws_cfg(tmp_path)
    ccfg = client_config(cfg, None)
    method = FedMosaic(ccfg)
    built = build_model(ccfg, method)
    method.client_id = 2
    state = method.init_client_state(built.model, ccfg)
    small_codec = small_base(state['small_cfg'], method.hparams).codec
    assert len(small_codec.tokenizer) == 300 and len(built.codec.tokenizer) == 400
    assert not same_tokenizer(built.codec, small_codec) and same_tokenizer(built.codec, built.codec)
    records = client_train_records(ccfg, 2)
    picked = [records[i] for i in (4, 0, 2)]       # not in record order
    batch = built.codec.collate([built.codec.encode(r) for r in picked])
    assert method.record_index is None
    assert RecordIndex(records, built.codec, 'test').records_of(batch) == picked
    own = method.small_batch(batch, state)
    expected = small_codec.collate([small_codec.encode(r) for r in picked])
    assert own.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(own[key], expected[key], rtol=0, atol=0)
    assert int(own['input_ids'].max()) < 300 and not torch.equal(own['input_ids'], batch['input_ids'])
    # the client's own tokenizer: its batch as it is
    same = FedMosaic(_cfg(tmp_path))
    same.client_codec = built.codec
    assert same.small_batch(batch, same.init_client_state(built.model, ccfg)) is batch


def test_a_batch_that_is_no_training_record_is_refused(tmp_path):
    cfg = _cfg(tmp_path)
    codec = small_base(cfg, FedMosaic(cfg).hparams).codec
    records = client_train_records(cfg, 1)
    stranger = {'instruction': 'a question nobody asked', 'input': '', 'output': 'none'}
    batch = codec.collate([codec.encode(records[0]), codec.encode(stranger)])
    with pytest.raises(ValueError, match="row 1 of the batch is none of the client's training"):
        RecordIndex(records, codec, 'client 1').records_of(batch)


@pytest.mark.slow
def test_ws_with_another_tokenizer_runs_end_to_end(tmp_path):
    cfg = _other_ws_cfg(tmp_path, 'federate.total_round_num', '1', 'train.local_update_steps', '2',
                        'fsplug.fedmosaic.gradient_every', '1', 'fsplug.fedmosaic.alignment_samples', '8',
                        'fsplug.fedmosaic.small_quantization', '4bit')
    results, clients = run_embedded_keeping_clients(cfg, read_yaml(CLIENTS))
    evals = [r for r in results.rows if r['kind'] == 'eval']
    assert len(evals) == 4 and all(r['test_avg_loss'] == r['test_avg_loss'] for r in evals)
    grads = torch.stack([c.method.client_extra(c.model, c.state)[GRAD_KEY] for c in clients.values()])
    small = small_base(next(iter(clients.values())).state['small_cfg'], FedMosaic(cfg).hparams).model
    assert grads.shape[1] == round(0.4 * small.model.layers[-1].mlp.down_proj.weight.numel())
    weights = rela_weights(grads)
    assert torch.isfinite(weights).all() and grads.abs().sum() > 0
    for proc in clients.values():
        assert proc.state['rela'].steps == 2 and proc.method.record_index is not None


def test_a_multimodal_ws_gets_its_own_pixels_and_tokens(tmp_path):
    """A tiny LLaVA client, a tiny Qwen2-VL W_s: W_s's batch is its own processor's encoding of
    the batch's records (pixels and image grid too); records alike in text are told apart by
    their images."""
    from test_multimodal import vl_config
    cfg, _ = vl_config(tmp_path, 'tiny_llava', fsplug={
        'method': 'fedmosaic', 'fedmosaic': {
            'num_blocks': 1, 'small_builder': 'tiny_qwen2_vl', 'small_model_type': 'tiny_qwen2_vl@fsplug_llm',
            'alignment_dir': str(tmp_path / 'align')}})
    method = FedMosaic(cfg)
    built = build_model(cfg, method)
    method.client_id = 1
    state = method.init_client_state(built.model, cfg)
    small_codec = small_base(state['small_cfg'], method.hparams).codec
    assert not same_tokenizer(built.codec, small_codec)
    picked = client_train_records(cfg, 1)[:3][::-1]
    batch = built.codec.collate([built.codec.encode(r) for r in picked])
    own = method.small_batch(batch, state)
    expected = small_codec.collate([small_codec.encode(r) for r in picked])
    assert own.keys() == expected.keys() and 'pixel_values' in own
    for key in expected:
        torch.testing.assert_close(own[key], expected[key], rtol=0, atol=0)
    assert int(own['input_ids'].max()) < len(small_codec.tokenizer)
    # the same question on images of different colours: only the pixels tell them apart
    # (the fixture's images of one colour are alike: any of them is the same sample)
    alike = [{**r, 'question': 'what is it?', 'answer': 'a'} for r in client_train_records(cfg, 1)]
    colours = {r['id'].split('-')[0]: i for i, r in enumerate(alike)}
    assert len(colours) >= 2
    order = sorted(colours.values(), reverse=True)
    batch = built.codec.collate([built.codec.encode(alike[i]) for i in order])
    found = RecordIndex(alike, built.codec, 'test').records_of(batch)
    assert [r['id'].split('-')[0] for r in found] == [alike[i]['id'].split('-')[0] for i in order]


def test_clients_of_another_tokenizer_than_the_pivot_run_end_to_end(tmp_path):
    """Cross-family federations (Tables 13 / 14 'FedMosaic'): clients 3-4 have another tokenizer
    than the pivot and W_s (the run's model): they align through the public records and feed
    W_s its own encoding of their batches."""
    cfg = _cfg(tmp_path, 'federate.total_round_num', '1', 'train.local_update_steps', '2',
               'fsplug.fedmosaic.gradient_every', '1', 'fsplug.fedmosaic.alignment_samples', '8')
    other = {'model': {'type': f'{_other_vocab_llama(tmp_path / "other")}@fsplug_llm'},
             'fsplug': {'model': {'builder': 'causal_lm'}}}
    results, clients = run_embedded_keeping_clients(cfg, {'client_3': other, 'client_4': other})
    evals = [r for r in results.rows if r['kind'] == 'eval']
    assert len(evals) == 4 and all(r['test_avg_loss'] == r['test_avg_loss'] for r in evals)
    assert len(clients[3].codec.tokenizer) == 300 and len(clients[1].codec.tokenizer) == 400
    assert clients[1].method.record_index is None and clients[3].method.record_index is not None
    grads = torch.stack([c.method.client_extra(c.model, c.state)[GRAD_KEY] for c in clients.values()])
    assert torch.isfinite(rela_weights(grads)).all()


# ------------------------------------------------------------------ through FederatedScope
@pytest.mark.fs
@pytest.mark.parametrize('variant', ['nbs', 'other_tokenizer_ws'])
def test_fs_standalone_gives_the_embedded_numbers(tmp_path, variant):
    """Both comparisons through FS standalone (clients on two model sizes): NBS's server state
    (the initial P, Q) and W_s's record index built from FS's own client data give the embedded
    runner's numbers."""
    from helpers import tiny_config, write_yaml
    from test_fs_integration import (
        HETEROGENEOUS,
        _embedded_rows,
        assert_same_numbers,
        read_rows,
        run_fs_in_process,
    )
    own = {'nbs': {'aggregation': 'nbs'},
           'other_tokenizer_ws': {'small_builder': 'causal_lm', 'small_model_type':
                                  f'{_other_vocab_llama(tmp_path / "ws")}@fsplug_llm'}}[variant]
    cfg = tiny_config(tmp_path, 'fedmosaic', rounds=2, steps=3, fsplug={
        'results_dir': str(tmp_path / 'fs'), 'data': {'public_holdout': 16}, 'fedmosaic': {
            'num_blocks': 1, 'gradient_every': 2, 'alignment_dir': str(tmp_path / 'align'), **own}})
    proc = run_fs_in_process(['--cfg', write_yaml(tmp_path / 'fs.yaml', cfg),
                   '--client_cfg', write_yaml(tmp_path / 'clients.yaml', HETEROGENEOUS)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_numbers(read_rows(str(tmp_path / 'fs')),
                        _embedded_rows(tmp_path, cfg, HETEROGENEOUS))
