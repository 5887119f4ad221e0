"""Small YAMLs for tests, derived from the shipped tiny YAML."""
import copy
import os

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(REPO, 'yamls', 'fedavg', 'tiny.yaml')
TESTS_DIR = os.path.join(REPO, 'tests')


def env_with_tests(**extra) -> dict:
    """The environment for a subprocess that imports the test-only modules (toy methods)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get('PYTHONPATH', '')]))
    env.update(extra)
    return env


class CreatesFile:
    """Creates the file `path` when unpickled: what a receiver must never do with a payload."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, 'w'))


def deep_update(base: dict, update: dict) -> dict:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_update(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def tiny_config(tmp_path, method='fedavg', rounds=2, steps=3, **updates) -> dict:
    with open(TINY_YAML) as handle:
        cfg = yaml.safe_load(handle)
    deep_update(cfg, {
        'expname': f'{method}_test', 'outdir': str(tmp_path / 'exp'),
        'federate': {'total_round_num': rounds},
        'data': {'root': str(tmp_path / 'data')},
        'train': {'local_update_steps': steps},
        'fsplug': {'method': method, 'results_dir': str(tmp_path / 'results')},
    })
    return deep_update(cfg, updates)


def write_yaml(path, cfg: dict) -> str:
    with open(path, 'w') as handle:
        yaml.safe_dump(cfg, handle)
    return str(path)


def run_embedded_keeping_clients(cfg, client_cfgs=None):
    """Runs the embedded runner on a loaded config; returns (results log, {client id:
    ClientProcedure}) so tests can inspect each client's model and state after the run."""
    from fs_plugins.sim import runner as runner_mod
    captured = {}
    original = runner_mod.build_clients

    def spy(*args, **kwargs):
        captured.update(original(*args, **kwargs))
        return captured
    runner_mod.build_clients = spy
    try:
        results = runner_mod.run_embedded(cfg, client_cfgs)
    finally:
        runner_mod.build_clients = original
    return results, captured


def tiny_yaml_of(method: str) -> str:
    """A registered method's tiny YAML: yamls/<name>/tiny.yaml, or tests/yamls/<name>/tiny.yaml
    for the test-only methods."""
    for root in (os.path.join(REPO, 'yamls'), os.path.join(REPO, 'tests', 'yamls')):
        path = os.path.join(root, method, 'tiny.yaml')
        if os.path.isfile(path):
            return path
    raise AssertionError(f"method '{method}' has no tiny YAML: add yamls/{method}/tiny.yaml")
