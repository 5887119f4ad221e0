"""NbAFL (nbafl.*, fs_plugins.run.privacy): the paper's σ_U, σ_D and clipping against naive
references; the noise measured on what clients upload and on what the server broadcasts in
tiny embedded runs; the frozen base untouched; the same seed giving the same numbers; and
through FS standalone, the upload the server receives."""
import math
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import deep_update, env_with_tests, run_embedded_keeping_clients, tiny_config, write_yaml

from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run import privacy
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import load_config
from fs_plugins.run.server import ServerProcedure

C, CONSTANT, EPSILON = 1.0, 30.0, 100.0


def _settings(rounds=10, clients=4, per_round=4, clip=C):
    return privacy.NbaflSettings(clip, CONSTANT, EPSILON, rounds, clients, per_round)


# ------------------------------------------------------------------ the maths
@pytest.mark.parametrize('rounds, size', [(1, 10), (10, 48), (50, 1000)])
def test_upload_sigma_is_theorem_1(rounds, size):
    sensitivity = 2 * C / size                          # ΔS_U = 2C/m
    expected = CONSTANT * rounds * sensitivity / EPSILON  # c·L·ΔS_U/ε with L = T
    assert privacy.upload_sigma(_settings(rounds=rounds), size) == pytest.approx(expected)


@pytest.mark.parametrize('rounds, clients, per_round, expect_noise', [
    (10, 4, 4, True),     # 10 > 4·2
    (8, 4, 4, False),     # 8 = 4·2: none
    (3, 4, 1, True),      # 3 > 1·2
    (2, 4, 1, False),
    (100, 100, 10, False),
])
def test_broadcast_sigma_is_theorem_2(rounds, clients, per_round, expect_noise):
    s, m = _settings(rounds, clients, per_round), 48
    sigma = privacy.broadcast_sigma(s, m)
    if not expect_noise:
        assert sigma == 0.0
        return
    expected = 2 * CONSTANT * C * math.sqrt(rounds ** 2 - per_round ** 2 * clients) / (m * clients * EPSILON)
    assert sigma == pytest.approx(expected) and sigma > 0


def test_settings_take_clients_per_round_from_the_sampling():
    def cfg(sampled):
        return SimpleNamespace(
            nbafl=SimpleNamespace(use=True, w_clip=2.0, constant=30.0, epsilon=10.0),
            federate=SimpleNamespace(client_num=8, sample_client_num=sampled, total_round_num=5))
    assert privacy.nbafl_settings(cfg(3)) == privacy.NbaflSettings(2.0, 30.0, 10.0, 5, 8, 3)
    assert privacy.nbafl_settings(cfg(-1)).per_round == 8
    assert privacy.nbafl_settings(cfg(20)).per_round == 8
    off = cfg(3)
    off.nbafl.use = False
    assert privacy.nbafl_settings(off) is None


def _payload(scale: float) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {'a': scale * torch.randn(3, 4, generator=generator),
            'b': scale * torch.randn(5, generator=generator, dtype=torch.float64),
            'cluster': torch.tensor(3)}


@pytest.mark.parametrize('scale', [10.0, 0.01])
def test_clipping_is_over_all_tensors_together(scale):
    payload = _payload(scale)
    before = {n: t.clone() for n, t in payload.items()}
    clipped = privacy.clip_to_norm(payload, C)
    flat = torch.cat([payload['a'].double().flatten(), payload['b'].flatten()])
    factor = max(1.0, float(flat.norm()) / C)   # naive: w / max(1, ||w|| / C)
    torch.testing.assert_close(clipped['a'], payload['a'] / factor)
    torch.testing.assert_close(clipped['b'], payload['b'] / factor)
    assert torch.equal(clipped['cluster'], torch.tensor(3))     # not a parameter
    assert privacy.joint_norm(clipped) == pytest.approx(min(float(flat.norm()), C))
    assert all(torch.equal(payload[n], before[n]) for n in payload)   # the input stays


def test_noise_is_seeded_and_new_tensors():
    payload = _payload(1.0)
    before = {n: t.clone() for n, t in payload.items()}
    one = privacy.add_gaussian_noise(payload, 0.5, lambda name: 7)
    again = privacy.add_gaussian_noise(payload, 0.5, lambda name: 7)
    other = privacy.add_gaussian_noise(payload, 0.5, lambda name: 8)
    assert all(torch.equal(one[n], again[n]) for n in payload)
    assert not torch.equal(one['a'], other['a'])
    assert one['b'].dtype == torch.float64 and torch.equal(one['cluster'], payload['cluster'])
    assert all(torch.equal(payload[n], before[n]) for n in payload)
    assert privacy.add_gaussian_noise(payload, 0.0, lambda name: 7)['a'] is payload['a']


# --------------------------------------------------------- tiny embedded runs
def _noise(received: dict, clean: dict) -> torch.Tensor:
    assert set(received) == set(clean)
    return torch.cat([(received[n].double() - clean[n].double()).flatten() for n in sorted(clean)])


def _assert_std(noise: torch.Tensor, sigma: float):
    # over ~10^4 entries the sample std is within about 1 % of σ
    assert noise.numel() > 5000
    assert float(noise.std()) == pytest.approx(sigma, rel=0.03)
    assert abs(float(noise.mean())) < 4 * sigma / math.sqrt(noise.numel())


def _frozen(model, trainable) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n not in set(trainable)}


def _recording_run(tmp_path, monkeypatch, **updates):
    """A tiny embedded FedAvg run with nbafl.use; records each upload with the client's
    shared tensors as trained (clipped as NbAFL clips them), and each content sent with the
    content of the server's state."""
    uploads, contents = [], []
    end_round, content_for = ClientProcedure.end_round, ServerProcedure.content_for

    def recorded_end_round(proc):
        update = end_round(proc)
        trained = proc.method.shared_tensors(proc.model, proc.trainable_names)
        uploads.append((proc.round_idx, proc.client_id, update, trained))
        return update

    def recorded_content_for(server, client_id, for_training=True):
        state = {n: t.clone() for n, t in server.method.content_for(server._state_of(client_id),
                                                                     client_id).items()}
        content = content_for(server, client_id, for_training)
        after = server.method.content_for(server._state_of(client_id), client_id)
        assert all(torch.equal(after[n], state[n]) for n in state)   # the state stays noise-free
        if for_training:
            contents.append((server.content_round, client_id, content, state))
        return content

    monkeypatch.setattr(ClientProcedure, 'end_round', recorded_end_round)
    monkeypatch.setattr(ServerProcedure, 'content_for', recorded_content_for)
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_config(write_yaml(tmp_path / 'nbafl.yaml', tiny_config(
        tmp_path, 'fedavg', **deep_update({'rounds': 2, 'steps': 1, 'nbafl': {'use': True}}, updates))))
    results, clients = run_embedded_keeping_clients(cfg)
    return cfg, results, clients, uploads, contents


def test_upload_carries_sigma_u_noise_on_the_clipped_tensors(tmp_path, monkeypatch):
    cfg, results, clients, uploads, contents = _recording_run(tmp_path, monkeypatch)
    settings = privacy.nbafl_settings(cfg)
    assert len(uploads) == 2 * 4
    for _, cid, update, trained in uploads:
        size = len(clients[cid].train_data)
        sigma = privacy.upload_sigma(settings, size)
        assert sigma == pytest.approx(CONSTANT * 2 * 2 * C / (size * EPSILON))
        assert privacy.joint_norm(trained) > C   # the clipping is at work here
        _assert_std(_noise(update.shared, privacy.clip_to_norm(trained, C)), sigma)
        assert all(t.dtype == torch.float32 for t in update.shared.values())
        assert update.metrics['nbafl_sigma_u'] == pytest.approx(sigma)
    # the rows record what was sent
    train_rows = [r for r in results.rows if r['kind'] == 'train']
    assert all(r['nbafl_sigma_u'] > 0 for r in train_rows)
    # T = 2 <= L·sqrt(N) = 8: the server adds no noise
    assert contents and all(all(torch.equal(content[n], state[n]) for n in state)
                            for _, _, content, state in contents)
    # the frozen base is the one built from the config, untouched
    fresh = build_model(cfg, get_method_class('fedavg')(cfg))
    expected = _frozen(fresh.model, fresh.trainable_names)
    for proc in clients.values():
        frozen = _frozen(proc.model, proc.trainable_names)
        assert set(frozen) == set(expected)
        assert all(torch.equal(frozen[n], expected[n]) for n in expected)


def test_broadcast_carries_sigma_d_noise_past_the_threshold(tmp_path, monkeypatch):
    # N = 4, L = 1, T = 3 > 1·sqrt(4): the server noises the content of rounds 1 and 2
    cfg, _, clients, uploads, contents = _recording_run(
        tmp_path, monkeypatch, rounds=3, federate={'sample_client_num': 1})
    settings = privacy.nbafl_settings(cfg)
    assert (settings.clients, settings.per_round, settings.rounds) == (4, 1, 3)
    assert [r for r, *_ in contents] == [0, 1, 2]
    first = contents[0]
    assert all(torch.equal(first[2][n], first[3][n]) for n in first[3])   # the initial state
    sizes = {cid: len(proc.train_data) for cid, proc in clients.items()}
    for round_idx, _, content, state in contents[1:]:
        heard = {cid for r, cid, *_ in uploads if r < round_idx}
        sigma = privacy.broadcast_sigma(settings, min(sizes[c] for c in heard))
        assert sigma == pytest.approx(2 * CONSTANT * C * math.sqrt(9 - 4) / (48 * 4 * EPSILON))
        _assert_std(_noise(content, state), sigma)


def test_same_seed_gives_the_same_noise(tmp_path, monkeypatch):
    _, first, _, uploads, _ = _recording_run(tmp_path / 'a', monkeypatch)
    monkeypatch.undo()
    _, second, _, again, _ = _recording_run(tmp_path / 'b', monkeypatch)
    assert len(uploads) == len(again)
    for (_, cid, update, _), (_, cid2, update2, _) in zip(uploads, again):
        assert cid == cid2 and all(torch.equal(update.shared[n], update2.shared[n]) for n in update.shared)
    numbers = lambda rows: [(r['kind'], r['round'], r['client'], r.get('train_avg_loss'),  # noqa: E731
                             r.get('test_avg_loss')) for r in rows]
    assert numbers(first.rows) == numbers(second.rows)
    # clients' noises differ
    one, two = uploads[0][2].shared, uploads[1][2].shared
    assert not torch.equal(_noise(one, uploads[0][3]), _noise(two, uploads[1][3]))


# ------------------------------------------------------------------ through FS


def run_fs_probed(tmp_path: pathlib.Path, cfg: dict):
    """An FS standalone run of `cfg` with tests/nbafl_probe.py recording under tmp_path/probe;
    returns (process, {name: recorded dict})."""
    import federatedscope
    probe = tmp_path / 'probe'
    probe.mkdir(parents=True)
    deep_update(cfg, {'fsplug': {'import_modules': ['nbafl_probe']}})
    proc = subprocess.run(
        [sys.executable, 'federatedscope/main.py', '--cfg', write_yaml(tmp_path / 'fs.yaml', cfg)],
        cwd=os.path.dirname(os.path.dirname(federatedscope.__file__)),
        env=env_with_tests(FSPLUG_PROBE_DIR=str(probe)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, {f[:-3]: torch.load(probe / f) for f in os.listdir(probe)}


@pytest.mark.fs
def test_fs_server_receives_noised_uploads_and_the_base_is_untouched(tmp_path):
    plain = load_config(write_yaml(tmp_path / 'plain.yaml', tiny_config(
        tmp_path, 'fedavg', rounds=2, steps=1, nbafl={'use': True})))
    proc, recorded = run_fs_probed(tmp_path, tiny_config(tmp_path, 'fedavg', rounds=2, steps=1,
                                                         nbafl={'use': True}))
    assert "FS's server noise injector is not used" in proc.stdout + proc.stderr
    settings = privacy.nbafl_settings(plain)
    fresh = build_model(plain, get_method_class('fedavg')(plain))
    base = _frozen(fresh.model, fresh.trainable_names)
    for round_idx in (0, 1):
        for cid in (1, 2, 3, 4):
            client = recorded[f'client_r{round_idx}_c{cid}']
            received = recorded[f'received_r{round_idx}_c{cid}']
            sigma = privacy.upload_sigma(settings, client['dataset_size'])
            _assert_std(_noise(received, privacy.clip_to_norm(client['shared'], C)), sigma)
            # FS's own NbAFL wrapping would have noised every parameter of the model
            assert set(client['frozen']) == set(base)
            assert all(torch.equal(client['frozen'][n], base[n]) for n in base)
    # one implementation for both runners: the embedded run gives the same numbers
    from test_fs_integration import _embedded_rows, assert_same_numbers, read_rows
    assert_same_numbers(read_rows(str(tmp_path / 'results')), _embedded_rows(
        tmp_path, tiny_config(tmp_path, 'fedavg', rounds=2, steps=1, nbafl={'use': True})))
