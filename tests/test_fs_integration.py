"""Runs through real FederatedScope (`python federatedscope/main.py`) when it is importable:
standalone and distributed (127.0.0.1), each compared number for number with the embedded
runner. Skipped, with the reason, on machines without FederatedScope."""
import json
import os
import subprocess
import sys

import pytest
import torch
import toy_methods  # noqa: F401  (registers the test-only toy_phased)
import yaml
from helpers import (
    deep_update,
    env_with_tests,
    outsiders_are_refused,
    tiny_config,
    tiny_yaml_of,
    untimed_rows,
    write_yaml,
)

from fs_plugins.methods.library_reuse import LibraryMethod
from fs_plugins.methods.registry import all_methods
from fs_plugins.run.config import load_config
from fs_plugins.sim.runner import run_embedded

pytestmark = pytest.mark.fs   # the fs tier: skipped, with the reason, without FederatedScope

TOY = {'fsplug': {'import_modules': ['toy_methods'], 'toy_phased': {'first_phase_steps': 1}}}


def fs_root() -> str:
    import federatedscope
    return os.path.dirname(os.path.dirname(federatedscope.__file__))


_env = env_with_tests


def run_fs(args, timeout=300, **env):
    return subprocess.run([sys.executable, 'federatedscope/main.py'] + args, cwd=fs_root(),
                          env=_env(**env), capture_output=True, text=True, timeout=timeout)


def run_fs_in_process(args) -> subprocess.CompletedProcess:
    """FS's own `federatedscope/main.py` run in this process (runpy, its argv and working
    folder as `run_fs` gives them), for the tests about a run's numbers rather than about the
    process: it saves the ~6 s a new interpreter spends importing torch, transformers, peft and
    FS. Returns what `run_fs` returns: exit status, the printed output, the traceback if any."""
    import contextlib
    import io
    import runpy
    import traceback
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    argv, cwd = sys.argv, os.getcwd()
    sys.argv = [os.path.join(fs_root(), 'federatedscope', 'main.py')] + list(args)
    os.chdir(fs_root())
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_path(sys.argv[0], run_name='__main__')
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:   # noqa: BLE001 -- reported as the subprocess would report it
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = argv
        os.chdir(cwd)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(sys.argv, code, stdout.getvalue(), stderr.getvalue())


def run_to_end(federation, timeout: int) -> None:
    """Starts a LocalFederation's server, then its clients once it listens, follows it to its
    end (at most `timeout` seconds) and stops every party whatever happens."""
    try:
        federation.start(federation.parties[0])
        federation.wait_listening(federation.parties[0], 120)
        for party in federation.parties[1:]:
            federation.start(party)
        federation.follow(timeout=timeout)
    finally:
        federation.stop_all()


def assert_distributed_matches_embedded(tmp_path, base: dict, client_cfgs: dict | None = None,
                                       timeout: int = 300, secure: str | None = None) -> list[dict]:
    """Runs `base` as a LocalFederation (a server and one process per client over gRPC,
    results in tmp_path/distributed) and asserts the embedded runner's numbers and saved models
    (the global state and every client's); returns the distributed run's rows."""
    from fs_plugins.commands.launch import LocalFederation
    base['fsplug']['results_dir'] = str(tmp_path / 'distributed')
    federation = LocalFederation(
        write_yaml(tmp_path / 'base.yaml', base),
        write_yaml(tmp_path / 'clients.yaml', client_cfgs) if client_cfgs else None,
        env=_env(), secure=secure)
    run_to_end(federation, timeout=timeout)
    rows = read_rows(federation.run_dir)
    assert_same_numbers(rows, _embedded_rows(tmp_path, base, client_cfgs))
    clients = int(base['federate']['client_num'])
    assert_same_artifacts(federation.run_dir, str(tmp_path / 'embedded'),
                          ['global'] + [f'client_{c}' for c in range(1, clients + 1)])
    return rows


def read_rows(results_dir):
    with open(os.path.join(results_dir, 'results.jsonl')) as handle:
        return [json.loads(line) for line in handle]


def assert_same_numbers(fs_rows, emb_rows):
    """The same rows, server rows included, with the same numbers; times left out."""
    key = lambda r: (r['kind'], r['round'], r['client'])  # noqa: E731
    fs_rows, emb_rows = sorted(untimed_rows(fs_rows), key=key), sorted(untimed_rows(emb_rows), key=key)
    assert [key(r) for r in fs_rows] == [key(r) for r in emb_rows]
    for a, b in zip(fs_rows, emb_rows):
        assert set(a) == set(b)
        for name, value in a.items():
            if isinstance(value, float):
                assert value == pytest.approx(b[name], rel=1e-5, abs=1e-6, nan_ok=True), (key(a), name)
            else:
                assert value == b[name], (key(a), name)


def assert_same_artifacts(fs_run, emb_run, folders=None):
    """The saved models (fs_plugins.run.artifacts) of an FS run equal the embedded run's: the
    same folders, files and tensors (the JSON differs only in paths and FS's own keys)."""
    import safetensors.torch
    fs_adapters, emb_adapters = os.path.join(fs_run, 'adapters'), os.path.join(emb_run, 'adapters')
    folders = folders or sorted(os.listdir(emb_adapters))
    assert sorted(os.listdir(fs_adapters)) == sorted(folders)
    for folder in folders:
        for root, _, files in os.walk(os.path.join(emb_adapters, folder)):
            rel = os.path.relpath(root, emb_adapters)
            fs_root_dir = os.path.join(fs_adapters, rel)
            assert sorted(f for f in os.listdir(fs_root_dir)
                          if os.path.isfile(os.path.join(fs_root_dir, f))) == sorted(files), rel
            for name in (f for f in files if f.endswith('.safetensors')):
                fs_t = safetensors.torch.load_file(os.path.join(fs_adapters, rel, name))
                emb_t = safetensors.torch.load_file(os.path.join(root, name))
                assert set(fs_t) == set(emb_t), (rel, name)
                for key in emb_t:   # float summation order differs a little between processes
                    torch.testing.assert_close(fs_t[key], emb_t[key], rtol=1e-3, atol=1e-4)
        with open(os.path.join(fs_adapters, folder, 'fsplug_artifact.json')) as handle, \
                open(os.path.join(emb_adapters, folder, 'fsplug_artifact.json')) as emb_handle:
            assert json.load(handle)['round'] == json.load(emb_handle)['round']


def _embedded_rows(tmp_path, cfg_dict, client_cfgs=None):
    cfg_dict = deep_update(json.loads(json.dumps(cfg_dict)),
                           {'fsplug': {'results_dir': str(tmp_path / 'embedded')}})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as FS standalone runs: the same float summation order
    try:
        run_embedded(load_config(write_yaml(tmp_path / 'embedded.yaml', cfg_dict)), client_cfgs)
    finally:
        torch.set_num_threads(threads)
    return read_rows(str(tmp_path / 'embedded'))


MIXED_RANKS = {f'client_{i}': {'fsplug': {'model': {'lora': {'r': r}}}}
               for i, r in zip((1, 2, 3, 4), (2, 4, 8, 16))}
HETEROGENEOUS = {f'client_{i}': {'model': {'type': t}} for i, t in
                 zip((1, 2, 3, 4), ['tiny-llama@fsplug_llm'] * 2 + ['tiny-llama-large@fsplug_llm'] * 2)}
FLAME_MODEL = {'model': {'type': 'tiny-olmoe@fsplug_llm'}, 'fsplug': {'model': {
    'builder': 'tiny_olmoe', 'lora': {'target_modules': ['q_proj', 'v_proj'], 'target_parameters': [
        'mlp.experts.gate_up_proj', 'mlp.experts.down_proj']}}}}
with open(tiny_yaml_of('uniflow')) as _handle:   # random tiny encoders + LLM on tiny_media
    _UNIFLOW = yaml.safe_load(_handle)
UNIFLOW_MODEL = {'federate': {'client_num': 3, 'sample_client_num': 3},
                 'data': {'type': _UNIFLOW['data']['type'], 'splitter': 'by_source'},
                 'llm': _UNIFLOW['llm'],
                 'fsplug': {k: _UNIFLOW['fsplug'][k] for k in ('uniflow', 'model', 'data')}}
# every registered method runs; these need a model or per-client configs of their own
MODEL_SETUP = {'flame': FLAME_MODEL, 'hetlora_experts': FLAME_MODEL,   # tiny OLMoE; FLAME's
               'uniflow': UNIFLOW_MODEL,
               'flexlora_experts': FLAME_MODEL,                      # clients at k = 8, 4, 2, 1
               'perada': {'fsplug': {'perada': {'kd_steps': 3, 'kd_batch_size': 4,
                                                'public_samples': 8},
                                     'aggregation': {'per_architecture': True}}},
               'fedmkt': {'fsplug': {'fedmkt': {'kd_batch_size': 4, 'public_samples': 8}}},
               # the alignment's public set: 16 training records held apart from every client
               'fedmosaic': {'fsplug': {'data': {'public_holdout': 16}}},
               'takfl': {'fsplug': {'takfl': {'kd_batch_size': 4, 'public_samples': 8,
                                              'search_candidates': 2}}}}
# the LoRA-reuse methods compose the builtin tiny library (tuners.library.builtin)
# methods whose defaults need more rounds or a setting the tiny run lacks: their tiny YAML's node
for _name in ('fedlease', 'dofit'):    # warm-up rounds; each client's domain
    with open(tiny_yaml_of(_name)) as _handle:
        MODEL_SETUP[_name] = {'fsplug': {_name: yaml.safe_load(_handle)['fsplug'][_name]}}
MODEL_SETUP.update({name: {'fsplug': {'model': {'library': {'adapters': ['builtin:tiny-a',
                                                                         'builtin:tiny-b']}}}}
                    for name, cls in all_methods().items() if issubclass(cls, LibraryMethod)})
CLIENT_CFGS = {'hetlora': MIXED_RANKS, 'flexlora': MIXED_RANKS, 'fed_a2': MIXED_RANKS,
               'hetlora_experts': MIXED_RANKS, 'flexlora_experts': MIXED_RANKS,
               'fedmosaic': HETEROGENEOUS,   # clients 3, 4 on a wider, deeper tiny Llama
               'perada': HETEROGENEOUS,      # one server distillation model per type
               'fedmkt': HETEROGENEOUS,      # clients of two model sizes around the server's
               'takfl': HETEROGENEOUS}       # two device prototypes
# fedavg's case is the fast tier's run through FS standalone (tests/test_runners.py)
METHODS = sorted(set(all_methods()) - {'fedavg'})


@pytest.mark.parametrize('method', METHODS)
def test_fs_standalone_matches_embedded(tmp_path, method):
    """Every method through FS standalone gives the embedded runner's numbers; hetlora and
    flexlora with four different LoRA ranks (FS alone fails there with a size mismatch)."""
    cfg = tiny_config(tmp_path, method, rounds=2, steps=3)
    if method == 'toy_phased':
        deep_update(cfg, TOY)
    deep_update(cfg, MODEL_SETUP.get(method, {}))
    if method == 'fedmosaic':
        deep_update(cfg, {'fsplug': {'fedmosaic': {'num_blocks': 1, 'gradient_every': 2,
                                                   'alignment_dir': str(tmp_path / 'align')}}})
    deep_update(cfg, {'fsplug': {'results_dir': str(tmp_path / 'fs')}})
    client_cfgs = CLIENT_CFGS.get(method)
    args = ['--cfg', write_yaml(tmp_path / 'fs.yaml', cfg)]
    if client_cfgs:
        args += ['--client_cfg', write_yaml(tmp_path / 'clients.yaml', client_cfgs)]
    proc = run_fs_in_process(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'Per-client results' in proc.stdout
    assert_same_numbers(read_rows(str(tmp_path / 'fs')), _embedded_rows(tmp_path, cfg, client_cfgs))
    assert_same_artifacts(str(tmp_path / 'fs'), str(tmp_path / 'embedded'))


def test_fs_standalone_pfl_dynamic_matches_embedded(tmp_path):
    """PFL-Dynamic with Others through FS: episodic memory, the visible test records and the
    others_* split evaluated by FS's clients give the embedded runner's numbers."""
    cfg = tiny_config(tmp_path, 'fedavg', rounds=4, steps=2, data={'splitter': 'iid'},
                      fsplug={'results_dir': str(tmp_path / 'fs'), 'data': {
                          'task_field': 'category', 'dynamic': True, 'task_order': 'rotated',
                          'evaluate_others': True}})
    proc = run_fs_in_process(['--cfg', write_yaml(tmp_path / 'fs.yaml', cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    fs_rows = read_rows(str(tmp_path / 'fs'))
    assert any('others_token_acc' in r for r in fs_rows)
    assert_same_numbers(fs_rows, _embedded_rows(tmp_path, cfg))


def test_fs_saves_models_at_rounds_without_evaluation(tmp_path):
    """save.freq 1 with evaluation only at the end: the server sends its evaluation content
    to every client at each save round (SAVE_MSG) and the clients save; same models as the
    embedded runner; the saved client model reloads with the run's final logits."""
    from fs_plugins import load_trained
    cfg = tiny_config(tmp_path, 'fedmole', rounds=3, steps=2, eval={'freq': 3},
                      fsplug={'save': {'freq': 1}})
    deep_update(cfg, {'fsplug': {'results_dir': str(tmp_path / 'fs')}})
    proc = run_fs(['--cfg', write_yaml(tmp_path / 'fs.yaml', cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    for round_idx in range(3):
        assert f'client 2 model (round {round_idx})' in log
        assert f'global state (round {round_idx})' in log
    assert_same_numbers(read_rows(str(tmp_path / 'fs')), _embedded_rows(tmp_path, cfg))
    assert_same_artifacts(str(tmp_path / 'fs'), str(tmp_path / 'embedded'))
    assert load_trained(str(tmp_path / 'fs'), client=2).model is not None


@pytest.mark.parametrize('method, secure', [('toy_phased', None), ('fedmole', 'certificate'),
                                            ('fedmosaic', 'token'), ('fedmkt', None),
                                            ('adalora', None), ('fwdllm', None),
                                            ('fedadapter', None)])
def test_fs_distributed_matches_embedded(tmp_path, method, secure):
    """Server + 2 clients launched over gRPC on 127.0.0.1 (plaintext, or TLS with clients
    authenticated by certificate or token, outsiders refused while it runs), with client-local
    state that persists across rounds and phases (toy_phased with extra payloads; fedmole's
    routed experts and routers; fedmosaic with the two clients on different models, each
    process naming the pivot; fedmkt's server model distilling with clients of two sizes;
    adalora's importance and budget masks; fwdllm's global direction and perturbation count;
    fedadapter's trial configurations, each client uploading only its assigned layers);
    bounded in time; same numbers as the embedded runner."""
    from fs_plugins.commands.credentials import make_credentials
    from fs_plugins.commands.launch import LocalFederation
    base = tiny_config(tmp_path, method, rounds=2, steps=3,
                       federate={'client_num': 2, 'sample_client_num': 2}, data={'splitter': 'iid'})
    if method == 'toy_phased':
        deep_update(base, TOY)
    deep_update(base, MODEL_SETUP.get(method, {}))
    # fedmosaic: client 2 runs the wider, deeper model in its own process
    own_model = {'client_2': HETEROGENEOUS['client_3']} if method in ('fedmosaic', 'fedmkt') else {}
    if method == 'fedmosaic':
        deep_update(base, {'fsplug': {'fedmosaic': {
            'num_blocks': 1, 'gradient_every': 2, 'alignment_dir': str(tmp_path / 'align'),
            'pivot_builder': 'tiny_llama', 'pivot_model_type': 'tiny-llama@fsplug_llm'}}})
    base['fsplug']['results_dir'] = str(tmp_path / 'distributed')
    federation = LocalFederation(write_yaml(tmp_path / 'base.yaml', base),
                                 write_yaml(tmp_path / 'clients.yaml', own_model) if own_model
                                 else None, env=_env(), secure=secure)
    server = federation.parties[0]
    refused_line = None
    try:
        federation.start(server)
        federation.wait_listening(server, 120)
        if secure:
            refused_line = outsiders_are_refused(
                server.address.port, federation.security,
                make_credentials(str(tmp_path / 'other_ca'), [1, 2]))
        for party in federation.parties[1:]:
            federation.start(party)
        federation.follow(timeout=240)
    finally:
        federation.stop_all()
    with open(server.log_path) as handle:
        server_log = handle.read()
    assert server_log.count('Per-client results') == 1
    assert ('TLS, auth ' + secure if secure else 'plaintext') in server_log
    if refused_line:
        assert refused_line in server_log
    run_dir = federation.run_dir
    assert_same_numbers(read_rows(run_dir), _embedded_rows(tmp_path, base, own_model or None))
    # the server writes the global state, each client process its own model
    assert_same_artifacts(run_dir, str(tmp_path / 'embedded'), ['global', 'client_1', 'client_2'])


@pytest.mark.parametrize('method, clients, secure', [('fedlease', 3, 'token'), ('dofit', 4, None)])
def test_fs_distributed_personalised_content_matches_embedded(tmp_path, method, clients, secure):
    """Content that differs per client and over time through FS's gRPC: FedLEASE's warm-up
    (nothing sent), then each cluster's expert with the other experts and the cluster id;
    DoFIT's per-domain LoRA. Same numbers and saved models as the embedded runner."""
    base = tiny_config(tmp_path, method, rounds=3, steps=3,
                       federate={'client_num': clients, 'sample_client_num': clients},
                       data={'splitter': 'iid'})
    deep_update(base, MODEL_SETUP[method])
    if method == 'dofit':
        base['fsplug']['dofit']['domains'] = [0, 0, 1, 1]
    assert_distributed_matches_embedded(tmp_path, base, secure=secure)


def test_cli_runs_through_fs(tmp_path):
    cfg = tiny_config(tmp_path, 'fedavg', rounds=1, steps=2)
    proc = subprocess.run([sys.executable, '-m', 'fs_plugins.commands.cli', 'run', '--cfg',
                           write_yaml(tmp_path / 'c.yaml', cfg), 'seed', '3'],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'running through FederatedScope' in proc.stderr + proc.stdout
    with open(tmp_path / 'results' / 'run_info.json') as handle:
        info = json.load(handle)
    assert info['runner'] == 'federatedscope' and info['seed'] == 3


def test_unknown_client_in_client_cfg_is_named(tmp_path):
    cfg_path = write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, 'fedavg', rounds=1, steps=1))
    client_cfg = write_yaml(tmp_path / 'clients.yaml', {'client_7': {'seed': 1}})
    proc = run_fs(['--cfg', cfg_path, '--client_cfg', client_cfg])
    assert proc.returncode != 0 and 'client_7' in proc.stderr


def test_unknown_plugin_key_fails_at_load(tmp_path):
    cfg = tiny_config(tmp_path, 'fedavg', fsplug={'model': {'lora': {'rnak': 4}}})
    proc = run_fs(['--cfg', write_yaml(tmp_path / 'c.yaml', cfg)])
    assert proc.returncode != 0 and "fsplug.model.lora.rnak" in proc.stderr
    assert 'alpha, dropout, r, target_modules' in proc.stderr


def test_fs_reports_every_problem_before_coercing_without_traceback(tmp_path):
    """The schema's checks run inside FS too: unknown FS keys get the closest spelling, a float
    for an int key is refused before yacs would coerce it, client entries are checked, and the
    problems are listed together without a traceback."""
    cfg_path = write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, 'fedavg', rounds=1, steps=1))
    proc = run_fs(['--cfg', cfg_path, 'federate.total_round_nm', '3', 'fsplug.model.lora.r', '8.5',
                   'train.optimizer.lr', '-1'])
    assert proc.returncode != 0 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
    for expected in ("Unknown config key 'federate.total_round_nm'. Did you mean 'federate.total_round_num'?",
                     'fsplug.model.lora.r = 8.5: expected int', 'train.optimizer.lr = -1: must be > 0'):
        assert expected in proc.stderr
    client_cfg = write_yaml(tmp_path / 'clients.yaml', {'client_2': {'fsplug': {'model': {'lora': {'r': 0}}}}})
    proc = run_fs(['--cfg', cfg_path, '--client_cfg', client_cfg])
    assert proc.returncode != 0 and '--client_cfg client_2: fsplug.model.lora.r = 0: must be >= 1' in proc.stderr


def test_fs_checkpoint_holds_the_global_shared_state(tmp_path):
    import torch
    cfg = tiny_config(tmp_path, 'fedavg', rounds=2, steps=1,
                      federate={'save_to': str(tmp_path / 'global.pt')})
    proc = run_fs(['--cfg', write_yaml(tmp_path / 'c.yaml', cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(tmp_path / 'global.pt', weights_only=False)
    assert ckpt['model'] and all('lora_' in k for k in ckpt['model'])


def test_unsupported_fs_feature_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, 'fedavg', quantization={'method': 'uniform'})
    proc = run_fs(['--cfg', write_yaml(tmp_path / 'c.yaml', cfg)])
    assert proc.returncode != 0 and 'quantization.method is not supported' in proc.stderr


def test_autoload_can_be_turned_off(tmp_path):
    cfg_path = write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, 'fedavg', rounds=1, steps=1))
    # without the hook FS needs the slow pure-Python protobuf even to start, and then
    # does not know the plugin's keys
    proc = run_fs(['--cfg', cfg_path], FSPLUG_NO_AUTOLOAD='1',
                  PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION='python')
    assert proc.returncode != 0 and 'Non-existent config key: fsplug' in proc.stderr


def test_grpc_module_is_regenerated_into_cache(tmp_path):
    code = ('import federatedscope.core.proto.gRPC_comm_manager_pb2 as m, os;'
            'print(m.__file__); m.MessageRequest()')
    proc = subprocess.run([sys.executable, '-c', code], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(os.environ['FSPLUG_CACHE'])


def test_fs_standalone_multimodal_with_generation_matches_embedded(tmp_path):
    """A tiny LLaVA on image records, with generation-based VQA accuracy, through FS
    standalone: same rows as the embedded runner (test_vqa_acc included)."""
    from test_multimodal import write_vqa_fixture
    write_vqa_fixture(str(tmp_path / 'data'))
    cfg = tiny_config(tmp_path, 'fedavg', rounds=2, steps=2)
    deep_update(cfg, {
        'data': {'root': str(tmp_path / 'data'), 'type': 'vqa.jsonl@fsplug', 'splitter': 'by_source'},
        'model': {'type': 'tiny_llava@fsplug_llm'}, 'llm': {'tok_len': 64},
        'federate': {'client_num': 2, 'sample_client_num': 2}, 'dataloader': {'batch_size': 4},
        'fsplug': {'results_dir': str(tmp_path / 'fs'),
                   'model': {'builder': 'tiny_llava', 'lora': {'target_modules': ['q_proj', 'v_proj']}},
                   'data': {'split_field': 'source', 'split_from_records': True},
                   'eval': {'generate': True, 'max_new_tokens': 3, 'gen_metrics': ['vqa_acc']}}})
    proc = run_fs_in_process(['--cfg', write_yaml(tmp_path / 'fs.yaml', cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    fs_rows = read_rows(str(tmp_path / 'fs'))
    assert any('test_vqa_acc' in r for r in fs_rows)
    assert_same_numbers(fs_rows, _embedded_rows(tmp_path, cfg, None))


def test_fs_evaluates_the_trained_models_as_the_embedded_runner(tmp_path):
    """fsplug.eval.point 'trained' under FS: clients evaluate (and save) their models as
    local training left them; the numbers and saved models are the embedded runner's."""
    cfg = tiny_config(tmp_path, 'fedavg', rounds=2, steps=3,
                      fsplug={'results_dir': str(tmp_path / 'fs'), 'eval': {'point': 'trained'}})
    proc = run_fs_in_process(['--cfg', write_yaml(tmp_path / 'fs.yaml', cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_numbers(read_rows(str(tmp_path / 'fs')), _embedded_rows(tmp_path, cfg))
