"""UniFLoW: the encoder + LLM model (prompt assembly of Eq. 4), II-stage local training
(Eq. 7 and the schedules of Appendix E.8), encoder LoRA federated with the chosen aggregation,
and bad input naming its record, key or file; on yamls/uniflow/tiny.yaml (random tiny
encoders and LLM, the locally made `tiny_media` data)."""
import pytest
import torch
from helpers import REPO, run_embedded_keeping_clients

from fs_plugins.aggregation.lora import fed_a2
from fs_plugins.aggregation.pairs import lora_pairs
from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.methods.uniflow import AGGREGATIONS, encoder_steps
from fs_plugins.models.encoder_llm import modalities
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import load_config
from fs_plugins.run.runtime import build_federated_records

TINY = f'{REPO}/yamls/uniflow/tiny.yaml'
BOTH_CLIENT = 2   # by_source clients in sorted group order: audio, both, image


def uniflow_cfg(tmp_path, *overrides):
    return load_config(TINY, ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
                              'fsplug.results_dir', str(tmp_path / 'results'), *overrides])


def one_client(tmp_path, client_id=BOTH_CLIENT, *overrides) -> ClientProcedure:
    cfg = uniflow_cfg(tmp_path, *overrides)
    method = get_method_class('uniflow')(cfg)
    records = build_federated_records(cfg)
    return ClientProcedure(client_id, cfg, method, build_model(cfg, method),
                           records.clients[client_id])


def part_of(name: str) -> str:
    return next(p for p in ('encoders', 'projectors', 'language_model') if f'.{p}.' in name)


def test_the_media_fields_are_the_configured_modalities():
    from fs_plugins.data.multimodal import MEDIA_FIELDS
    assert set(modalities()) == set(MEDIA_FIELDS) == {'image', 'audio'}


def test_prompt_is_bos_before_features_gap_question_after(tmp_path):
    proc = one_client(tmp_path)
    codec, tokenizer = proc.codec, proc.codec.tokenizer
    record = next(r for r in proc.train_data.records if r.get('image') and r.get('audio'))
    example = codec.encode(record)
    ids, slots = example['input_ids'].tolist(), example['feature_slots'].tolist()
    assert ids[0] == tokenizer.bos_token_id and slots[0] == 0
    first, last = slots.index(1), len(slots) - 1 - slots[::-1].index(2)
    # the image's 4 pooled features, then the audio's 4 (modality order of the config)
    assert slots[first:last + 1] == [1] * 4 + [2] * 4
    before = tokenizer.decode(ids[1:first])
    assert before == 'Start of the conversation. ### Human: <image, audio>'
    prompt_end = example['labels'].tolist().index(next(x for x in example['labels'].tolist()
                                                       if x != -100))
    after = tokenizer.decode(ids[last + 1:prompt_end])
    assert after == ("</image, audio> Now, here's the question based on the above features: "
                     f"{record['question']} Based on the above input and question, please "
                     "provide your response.")
    assert tokenizer.decode(ids[prompt_end:]).strip() == record['answer'] + tokenizer.eos_token
    assert example['pixel_values'].shape[0] == 1 and example['input_features'].shape[0] == 1


def test_features_land_in_their_slots(tmp_path):
    proc = one_client(tmp_path)
    model = proc.model.base_model.model
    batch = proc.collate([proc.train_data[i] for i in range(2)])
    embeds = model.embed(batch['input_ids'], batch['feature_slots'],
                         {k: batch[k] for k in ('pixel_values', 'input_features')})
    text = model.language_model.get_input_embeddings()(batch['input_ids'])
    slots = batch['feature_slots'] > 0
    assert torch.equal(embeds[~slots], text[~slots])
    image = model.projectors['image'](model.encoders['image'](batch['pixel_values']).mean(1))
    assert not torch.allclose(embeds[batch['feature_slots'] == 1], text[batch['feature_slots'] == 1])
    pooled = embeds[batch['feature_slots'] == 1].reshape(2, 4, -1).mean(1)
    assert torch.allclose(pooled, image, atol=1e-5)   # adaptive pooling of 4 keeps the mean


def trained_parts_per_step(proc) -> list[set]:
    """Trains one local round; per step, which model parts received a gradient."""
    proc.begin_round()
    parts = []
    for _ in range(len(proc.step_phases)):
        batch = proc.next_batch()
        proc.optimise(proc.compute_loss(batch))
        parts.append({part_of(n) for n in proc.trainable_names if proc.params[n].grad is not None})
        proc.record(0.0, 1)
    proc.end_round()
    return parts


ENCODER_SIDE, LLM_SIDE = {'encoders', 'projectors'}, {'language_model'}


@pytest.mark.parametrize('schedule, round_idx, expected', [
    ('two_stage', 0, [ENCODER_SIDE] * 2 + [LLM_SIDE] * 6),      # τ·S = 0.25·8 steps first
    ('reverse', 0, [LLM_SIDE] * 6 + [ENCODER_SIDE] * 2),
    ('simultaneous', 0, [ENCODER_SIDE | LLM_SIDE] * 8),
    ('round', 1, [ENCODER_SIDE] * 8),                            # t < 0.5·4 rounds
    ('round', 2, [LLM_SIDE] * 8),
])
def test_stage_switch_decides_which_parameters_get_gradients(tmp_path, schedule, round_idx,
                                                             expected):
    proc = one_client(tmp_path, BOTH_CLIENT, 'fsplug.uniflow.schedule', schedule)
    proc.round_idx = round_idx
    assert trained_parts_per_step(proc) == expected


@pytest.mark.parametrize('tau, steps, expected', [(0.25, 8, 2), (0.25, 10, 3), (0.25, 6, 2),
                                                  (0.3, 10, 3), (0.0, 5, 0), (1.0, 5, 5),
                                                  (0.25, 1, 1)])
def test_two_stage_encoder_steps_are_those_with_step_below_tau(tau, steps, expected):
    """UniFLoW Eq. 7: local step s (of S) trains the encoder side while s/S < τ."""
    assert encoder_steps(tau, steps) == expected == sum(s / steps < tau for s in range(steps))


def test_projector_can_train_with_the_llm(tmp_path):
    proc = one_client(tmp_path, BOTH_CLIENT, 'fsplug.uniflow.projector_stage', 'llm')
    parts = trained_parts_per_step(proc)
    assert parts == [{'encoders'}] * 2 + [{'language_model', 'projectors'}] * 6


HOLDERS = {'image': (2, 3), 'audio': (1, 2)}   # tiny_media clients: audio, both, image


def test_encoder_lora_is_aggregated_with_fed_a2_over_its_modality_holders(tmp_path):
    """Each client uploads the LLM LoRA and the modules of its own modalities only; the server
    runs FedA² on each modality's encoder LoRA over the clients holding it (weights renormalised
    over them), averages P_m over them, and every client, even one without that modality,
    receives the global modules."""
    cfg = uniflow_cfg(tmp_path, 'federate.total_round_num', '1')
    from fs_plugins.sim import runner as runner_mod
    updates = []
    original = runner_mod.ServerProcedure.aggregate

    def spy(self, round_idx, round_updates):
        updates.extend(round_updates)
        return original(self, round_idx, round_updates)
    runner_mod.ServerProcedure.aggregate = spy
    try:
        results, clients = run_embedded_keeping_clients(cfg)
    finally:
        runner_mod.ServerProcedure.aggregate = original
    assert not [r for r in results.rows if r['kind'] == 'rejected']
    by_id = {u.client_id: u for u in updates}
    assert sorted(by_id) == [1, 2, 3]
    for modality, ids in HOLDERS.items():
        for cid, update in by_id.items():
            sent = {k for k in update.shared if f'.{modality}.' in k}
            assert bool(sent) == (cid in ids), (modality, cid)
            if sent:
                assert any('lora_A' in k for k in sent) and any('.projectors.' in k for k in sent)
    global_ = clients[1].params   # client 1 holds no image, yet receives the global image modules
    for modality, ids in HOLDERS.items():
        group = [by_id[c] for c in ids]
        weights = [float(u.dataset_size) for u in group]
        keys = {k for k in group[0].shared if f'.{modality}.' in k}
        pairs = [ab for ab in lora_pairs(keys).values()]
        assert pairs
        for a_key, b_key in pairs:
            a, b = fed_a2([u.shared[a_key] for u in group], [u.shared[b_key] for u in group],
                          weights, lam=0.1)
            assert torch.allclose(global_[a_key], a, atol=1e-6)
            assert torch.allclose(global_[b_key], b, atol=1e-5)
        for key in keys - {k for ab in pairs for k in ab}:   # P_m: averaged over the holders
            mean = sum(w * u.shared[key] for w, u in zip(weights, group)) / sum(weights)
            assert torch.allclose(global_[key], mean, atol=1e-6)
    everyone = [by_id[c] for c in (1, 2, 3)]
    llm_pairs = [ab for ab in lora_pairs(everyone[0].shared).values() if '.language_model.' in ab[0]]
    assert llm_pairs and all(all(ab[0] in u.shared for u in everyone) for ab in llm_pairs)
    a_key, b_key = llm_pairs[0]
    a, _ = fed_a2([u.shared[a_key] for u in everyone], [u.shared[b_key] for u in everyone],
                  [float(u.dataset_size) for u in everyone], lam=0.1)
    assert torch.allclose(global_[a_key], a, atol=1e-6)


def clients_of(tmp_path, ids, client_cfgs=None, *overrides):
    from fs_plugins.run.config import client_overrides
    from fs_plugins.run.runtime import build_clients
    cfg = uniflow_cfg(tmp_path, *overrides)
    records = build_federated_records(cfg)
    return cfg, build_clients(cfg, get_method_class('uniflow'), records,
                              client_overrides(client_cfgs, cfg), 'cpu', ids)


def modality_names(names, modality) -> set:
    return {n for n in names if f'.encoders.{modality}.' in n or f'.projectors.{modality}.' in n}


def test_a_client_without_images_neither_trains_nor_uploads_the_image_modules(tmp_path):
    cfg, procs = clients_of(tmp_path, [1, 2])
    audio, both = procs[1], procs[2]
    assert audio.cfg.fsplug.uniflow.client_modalities == ['audio']   # 'auto', from its records
    assert both.cfg.fsplug.uniflow.client_modalities == ['auto']     # all: the run's config
    image_params = modality_names(both.trainable_names, 'image')   # encoder LoRA and P_image
    assert image_params and not image_params & set(audio.trainable_names)
    assert modality_names(both.trainable_names, 'audio') <= set(audio.trainable_names)
    # it receives the global image modules (evaluation of image inputs uses them) ...
    content = {n: torch.full_like(audio.params[n], 0.5) for n in image_params}
    audio.receive(content)
    assert all(torch.equal(audio.params[n], content[n]) for n in image_params)
    # ... but no phase trains them and they are not uploaded
    for phase in audio.method.phases(audio.steps_per_round(), audio.cfg):
        assert not any(phase.trainable(n) for n in image_params if n in audio.trainable_names)
    parts = trained_parts_per_step(audio)
    assert parts[0] == ENCODER_SIDE
    assert all(torch.equal(audio.params[n], content[n]) for n in image_params)
    update = audio.end_round()
    assert not modality_names(update.shared, 'image')
    assert modality_names(update.shared, 'audio') and any('.language_model.' in n for n in update.shared)


def test_client_modalities_can_be_listed_per_client(tmp_path):
    """--client_cfg fsplug.uniflow.client_modalities: client 2 holds images and tones but
    trains the audio side only; the server builds its expected upload from that config."""
    client_cfgs = {'client_2': {'fsplug': {'uniflow': {'client_modalities': ['audio']}}}}
    _, procs = clients_of(tmp_path, [2], client_cfgs)
    proc = procs[2]
    assert not modality_names(proc.trainable_names, 'image')
    from fs_plugins.aggregation.signature import signature_of
    from fs_plugins.run.server import client_shared_shapes
    proc.begin_round()
    sent = proc.end_round().shared
    assert client_shared_shapes(proc.cfg, get_method_class('uniflow')) == signature_of(sent)


@pytest.mark.parametrize('listed, problem', [
    (['auto', 'image'], "'auto' stands alone"),
    (['image'], "lists 'image', which has no encoder"),
])
def test_client_modalities_must_be_configured(tmp_path, listed, problem):
    with pytest.raises(ConfigError, match=problem):
        uniflow_cfg(tmp_path, 'fsplug.uniflow.client_modalities', listed,
                    *(['fsplug.model.multimodal.image.backend', ''] if listed == ['image'] else []))


def lora_layer(seed, d=6, r=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, d, generator=g), torch.randn(d, r, generator=g)


@pytest.mark.parametrize('aggregation', ['fedavg', 'fed_a2'])
def test_the_server_aggregates_each_modality_over_the_clients_that_sent_it(tmp_path, aggregation):
    from fs_plugins.methods.base import ClientUpdate
    cfg = uniflow_cfg(tmp_path, 'fsplug.uniflow.aggregation', aggregation)
    method = get_method_class('uniflow')(cfg)
    layer = {'llm': 'base_model.model.language_model.layers.0.q_proj',
             'image': 'base_model.model.encoders.image.layers.0.q_proj',
             'audio': 'base_model.model.encoders.audio.layers.0.q_proj'}
    proj = {m: f'base_model.model.projectors.{m}.weight' for m in ('image', 'audio')}

    def tensors(seed, parts):
        out = {}
        for part in parts:
            a, b = lora_layer(seed * 10 + len(part))
            out[f'{layer[part]}.lora_A.default.weight'] = a
            out[f'{layer[part]}.lora_B.default.weight'] = b
            if part in proj:
                out[proj[part]] = torch.full((3, 2), float(seed))
        return out
    initial = tensors(0, ('llm', 'image', 'audio'))
    state = method.init_server_state(initial)
    sizes = {1: 10, 2: 30, 3: 60}
    # client 1: audio only; clients 2, 3: images only; nobody sends audio's... (see below)
    sent = {1: ('llm', 'audio'), 2: ('llm', 'image'), 3: ('llm', 'image')}
    updates = [ClientUpdate(c, sizes[c], tensors(c, parts), dataset_size=sizes[c], weight=sizes[c])
               for c, parts in sent.items()]
    new = method.aggregate(state, updates)['global']
    direct = get_method_class(aggregation)(cfg)

    def alone(ids, part):
        group = [u for u in updates if u.client_id in ids]
        names = {k for k in group[0].shared if layer[part] in k or k == proj.get(part)}
        sub = [ClientUpdate(u.client_id, u.num_samples, {k: u.shared[k] for k in names},
                            dataset_size=u.dataset_size, weight=u.weight) for u in group]
        return direct.aggregate(direct.init_server_state({k: initial[k] for k in names}), sub)['global']
    for ids, part in (((2, 3), 'image'), ((1,), 'audio'), ((1, 2, 3), 'llm')):
        expected = alone(ids, part)
        assert expected and all(torch.allclose(new[k], v, atol=1e-6) for k, v in expected.items())
    # P_image: the average over the image clients 2 and 3 only (weights 30 : 60)
    assert torch.allclose(new[proj['image']], torch.full((3, 2), (2 * 30 + 3 * 60) / 90))
    assert torch.allclose(new[proj['audio']], torch.full((3, 2), 1.0))
    # a module no client sent this round keeps its global value
    state = method.init_server_state(initial)
    llm_only = [ClientUpdate(u.client_id, u.num_samples,
                             {k: v for k, v in u.shared.items() if layer['llm'] in k},
                             dataset_size=u.dataset_size, weight=u.weight) for u in updates]
    image_only = [ClientUpdate(4, 5, tensors(4, ('image',)), dataset_size=5, weight=5)]
    new = method.aggregate(state, llm_only + image_only)['global']
    for key in (k for k in initial if layer['audio'] in k or k == proj['audio']):
        assert new[key] is initial[key]


def test_the_audit_of_the_tiny_yaml_finds_no_problem(tmp_path):
    from fs_plugins.commands.audit import audit_yaml
    from fs_plugins.run.audit import format_report
    report = audit_yaml(f'{REPO}/yamls/uniflow/tiny.yaml', None,
                        ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp')],
                        tiny=False, steps=8)
    assert report.problems == [], format_report(report)
    rows = {r.group: r for r in report.rows}
    image = [r for g, r in rows.items() if g.startswith(('encoders.image.', 'projectors.image.'))]
    assert image and all(r.up_tensors == 1 for r in image)   # one of the two clients sends them


def test_easyvqa_image_audio_clients_hold_their_own_modalities(tmp_path):
    """yamls/uniflow/easyvqa_image_audio.yaml: image-k clients (written questions) hold images
    only, spoken-k clients images and spoken questions: the former keep the audio modules
    frozen and unsent, the latter train and send both."""
    from fs_plugins.run.config import client_config
    cfg = load_config(f'{REPO}/yamls/uniflow/easyvqa_image_audio.yaml',
                      ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp')])
    uniflow = get_method_class('uniflow')
    image = client_config(cfg, None)
    uniflow.resolve_client_config(image, {'train': [{'image': 'a.png', 'question': 'q'}] * 2})
    spoken = client_config(cfg, None)
    uniflow.resolve_client_config(spoken, {'train': [{'image': 'a.png', 'audio': 'q.wav'}]})
    assert uniflow.own_modalities(image) == ('image',)
    assert image.fsplug.uniflow.client_modalities == ['image']
    assert uniflow.own_modalities(spoken) == ('image', 'audio')
    assert spoken == cfg   # every configured modality: the run's own config, the run's upload


@pytest.mark.slow
@pytest.mark.parametrize('aggregation', [a for a in AGGREGATIONS if a != 'fed_a2'])
def test_every_aggregation_runs_the_encoder_llm(tmp_path, aggregation):
    cfg = uniflow_cfg(tmp_path, 'fsplug.uniflow.aggregation', aggregation,
                      'federate.total_round_num', '1', 'train.local_update_steps', '4')
    results, clients = run_embedded_keeping_clients(cfg)
    evals = [r for r in results.rows if r['kind'] == 'eval']
    assert len(evals) == 3 and all(r['test_avg_loss'] == r['test_avg_loss'] for r in evals)
    assert clients[1].method.aggregator.name == aggregation


# ------------------------------------------------------------------ bad input
def test_uniflow_needs_the_encoder_llm_builder(tmp_path):
    with pytest.raises(ConfigError, match="fsplug.model.builder = 'tiny_llama'.*imagebind_vicuna"):
        uniflow_cfg(tmp_path, 'fsplug.model.builder', 'tiny_llama')


def test_unknown_modality_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match='fsplug.model.multimodal.video'):
        uniflow_cfg(tmp_path, 'fsplug.model.multimodal.video.backend', 'tiny_clip')


def test_prompt_without_placeholder_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r'fsplug.model.multimodal.prompt.gap.*\{modality\}'):
        one_client(tmp_path, 1, 'fsplug.model.multimodal.prompt.gap', 'Question: ')


def test_modality_without_encoder_names_the_record_and_key(tmp_path):
    proc = one_client(tmp_path, 1, 'fsplug.model.multimodal.audio.backend', '')
    record = next(r for r in proc.train_data.records if r.get('audio'))
    with pytest.raises(ConfigError, match=rf"Record {record['id']} has audio input.*"
                                          r"fsplug.model.multimodal.audio.backend"):
        proc.codec.encode(record)


def test_unknown_modality_in_a_record_is_named(tmp_path):
    proc = one_client(tmp_path, 1)
    record = {**proc.train_data.records[0], 'modalities': ['audio', 'smell']}
    with pytest.raises(ValueError, match=rf"Record {record['id']}: unknown modality \['smell'\]"):
        proc.codec.encode(record)


def test_missing_audio_file_names_it(tmp_path):
    import json
    cfg = uniflow_cfg(tmp_path)
    build_federated_records(cfg)
    path = tmp_path / 'data' / 'tiny_media.jsonl'
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[0]['audio'] = 'tiny_media/nowhere.wav'
    bad = tmp_path / 'bad.jsonl'
    bad.write_text('\n'.join(json.dumps(r) for r in records))
    (tmp_path / 'tiny_media').symlink_to(tmp_path / 'data' / 'tiny_media')
    with pytest.raises(FileNotFoundError, match=rf"Audio file not found: .*nowhere.wav "
                                                rf"\(record {records[0]['id']}"):
        build_federated_records(uniflow_cfg(tmp_path, 'data.root', str(tmp_path),
                                            'data.type', 'bad.jsonl@fsplug'))



# ------------------------------------------------------------------ ImageBind backend
def FakeTrunk(width):
    """One block of ImageBind's trunk layout: a real nn.MultiheadAttention called as ImageBind
    calls it (its out_proj bypassed unless the backend wraps it), fc1 / fc2."""
    from fs_plugins.models.imagebind_layout import Trunk
    return Trunk(width, blocks=1, heads=2, mlp=2 * width, pre_norm=False, add_bias_kv=False)


class FakeImageBind(torch.nn.Module):
    """The attributes of ImageBind's model that the backend uses, at a tiny width."""

    def __init__(self, width=16, out=24):
        super().__init__()
        keys = ('vision', 'audio')
        self.modality_preprocessors = torch.nn.ModuleDict(
            {'vision': FakePreprocessor('vision', 3 * 4 * 4, width),
             'audio': FakePreprocessor('audio', 4 * 6, width)})
        self.modality_trunks = torch.nn.ModuleDict({k: FakeTrunk(width) for k in keys})
        self.modality_heads = torch.nn.ModuleDict(
            {k: FakeHead(width, out) for k in keys})
        self.modality_postprocessors = torch.nn.ModuleDict(
            {k: torch.nn.Identity() for k in keys})


class FakePreprocessor(torch.nn.Module):
    def __init__(self, key, size, width):
        super().__init__()
        self.key, self.embed = key, torch.nn.Linear(size, width)

    def forward(self, **inputs):
        tokens = self.embed(inputs[self.key].flatten(1)).unsqueeze(1)
        return {'trunk': {'tokens': tokens}, 'head': {}}


class FakeHead(torch.nn.Sequential):
    def __init__(self, width, out):
        super().__init__(torch.nn.Identity(), torch.nn.Linear(width, out))

    def forward(self, states):
        return super().forward(states[:, 0])


@pytest.fixture
def fake_imagebind(monkeypatch):
    import sys
    import types
    package, models, data = (types.ModuleType(n) for n in
                             ('imagebind', 'imagebind.models', 'imagebind.data'))
    models.imagebind_model = types.SimpleNamespace(
        imagebind_huge=lambda pretrained: FakeImageBind())
    data.load_and_transform_vision_data = lambda paths, device: torch.ones(len(paths), 3, 4, 4)
    data.load_and_transform_audio_data = lambda paths, device: torch.ones(len(paths), 3, 1, 4, 6)
    package.models, package.data = models, data
    for name, module in (('imagebind', package), ('imagebind.models', models),
                         ('imagebind.models.imagebind_model', models.imagebind_model),
                         ('imagebind.data', data)):
        monkeypatch.setitem(sys.modules, name, module)


def test_imagebind_backend_gives_one_global_feature_per_input(tmp_path, fake_imagebind):
    proc = one_client(tmp_path, BOTH_CLIENT,
                      'fsplug.model.multimodal.image.backend', 'imagebind',
                      'fsplug.model.multimodal.image.pool_tokens', '1',
                      'fsplug.model.multimodal.audio.backend', 'imagebind',
                      'fsplug.model.multimodal.audio.pool_tokens', '1',
                      'fsplug.model.multimodal.image.lora_targets', ['out_proj'],
                      'fsplug.model.multimodal.audio.lora_targets', ['out_proj'])
    assert {part_of(n) for n in proc.trainable_names} == {'encoders', 'projectors',
                                                          'language_model'}
    example = proc.train_data[0]
    assert example['feature_slots'].tolist().count(1) == example['feature_slots'].tolist().count(2) == 1
    assert example['audio_clips'].shape == (1, 3, 1, 4, 6)
    assert trained_parts_per_step(proc)[0] == ENCODER_SIDE
    encoder_lora = [n for n in proc.trainable_names if 'out_proj.lora_' in n]
    assert len(encoder_lora) == 4   # A and B, image and audio trunks
    proc.model.zero_grad()
    batch = proc.collate([proc.train_data[0]])
    proc.model(**batch).loss.backward()
    params = dict(proc.model.named_parameters())
    assert all(params[n].grad is not None and params[n].grad.abs().sum() > 0
               for n in encoder_lora if 'lora_B' in n)


def test_imagebind_refuses_several_pool_tokens(tmp_path, fake_imagebind):
    with pytest.raises(ConfigError, match='fsplug.model.multimodal.image.pool_tokens = 4'):
        one_client(tmp_path, BOTH_CLIENT, 'fsplug.model.multimodal.image.backend', 'imagebind')


@pytest.mark.parametrize('backend', ['clip', 'siglip'])
def test_transformers_vision_backends_load_from_a_folder(tmp_path, backend):
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModel,
        SiglipImageProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
    )
    dims = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2)
    model_class, config_class, processor = {
        'clip': (CLIPVisionModel, CLIPVisionConfig,
                 CLIPImageProcessor(size={'shortest_edge': 32}, crop_size={'height': 32, 'width': 32})),
        'siglip': (SiglipVisionModel, SiglipVisionConfig,
                   SiglipImageProcessor(size={'height': 32, 'width': 32}))}[backend]
    folder = tmp_path / backend
    model_class(config_class(**dims)).save_pretrained(folder)
    processor.save_pretrained(folder)
    proc = one_client(tmp_path, 3, 'fsplug.model.multimodal.image.backend', backend,
                      'fsplug.model.multimodal.image.path', str(folder))
    batch = proc.collate([proc.train_data[0]])
    # 4 x 4 patches: CLIP's CLS state is left out, SigLIP has none
    assert proc.model.base_model.model.encoders['image'](batch['pixel_values']).shape == (1, 16, 32)
    assert trained_parts_per_step(proc)[0] == ENCODER_SIDE


def test_whisper_backend_cuts_its_window_to_max_seconds(tmp_path):
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperModel
    folder = tmp_path / 'whisper'
    WhisperModel(WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                               encoder_attention_heads=2, decoder_attention_heads=2,
                               encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80)
                 ).save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    proc = one_client(tmp_path, 1, 'fsplug.model.multimodal.audio.backend', 'whisper',
                      'fsplug.model.multimodal.audio.path', str(folder),
                      'fsplug.model.multimodal.audio.max_seconds', '0.6')
    example = proc.train_data[0]
    assert example['input_features'].shape == (1, 80, 60)          # 100 mel frames a second
    states = proc.model.base_model.model.encoders['audio'](example['input_features'])
    assert states.shape == (1, 30, 32)                               # 50 positions a second
    assert trained_parts_per_step(proc)[0] == ENCODER_SIDE


def test_frozen_projectors_are_never_shared_between_models():
    """The process shares frozen base tensors between models of the same base; a projector (a
    module a participant may train or receive: here a client's projector of a modality it
    lacks, frozen) is its own, since the server's content overwrites it in place."""
    from types import SimpleNamespace

    from fs_plugins.models.builders import own_module_fragments, share_frozen_tensors

    def model():
        module = torch.nn.ModuleDict({'layer': torch.nn.Linear(2, 2),
                                      'projectors': torch.nn.ModuleDict({'image': torch.nn.Linear(2, 2)})})
        module.requires_grad_(False)
        return module
    base = SimpleNamespace(trained_modules=['head.'], trainable_switches={'train_projector': 'projectors.'})
    fragments = own_module_fragments(base)
    assert fragments == ('head.', 'projectors.')
    key = ('test_frozen_projectors', '', 'float32')
    first, second = model(), model()
    for built in (first, second):
        share_frozen_tensors(built, key, {id(p) for p in built.parameters()}, fragments)
    assert second.layer.weight.data_ptr() == first.layer.weight.data_ptr()
    assert second.projectors.image.weight.data_ptr() != first.projectors.image.weight.data_ptr()
    from fs_plugins.models.builders import _FROZEN_CACHE
    _FROZEN_CACHE.pop(key)
