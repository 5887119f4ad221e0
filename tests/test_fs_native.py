"""Native FederatedScope runs (no `fsplug.method`) are untouched by the installed plugin:
importing FS's config loads neither transformers nor peft, and a native run's saved
config.yaml has no `fsplug` node, so it loads in FS without the plugin. A plugin config keeps
its node. Each check runs in a fresh interpreter (this one has imported torch and
transformers for other tests). Skipped, with the reason, on machines without FederatedScope."""
import json
import subprocess
import sys

import pytest
import yaml
from helpers import env_with_tests, tiny_config, write_yaml

pytestmark = pytest.mark.fs   # the fs tier: skipped, with the reason, without FederatedScope

HEAVY = ('transformers', 'peft')

# prints, as JSON: which of HEAVY are loaded, whether the config keeps `fsplug`, and whether
# the plugin's FS modules were loaded; argv: outdir, then `--cfg <yaml>` or FS opts
FREEZE = '''
import json, sys
from federatedscope.core.configs.config import global_cfg
cfg = global_cfg.clone()
args = sys.argv[2:]
if args[:1] == ['--cfg']:
    cfg.merge_from_file(args[1])
    args = args[2:]
cfg.merge_from_list(['outdir', sys.argv[1]] + args)
cfg.freeze(inform=False)
print(json.dumps({'heavy': [m for m in HEAVY if m in sys.modules], 'fsplug': 'fsplug' in cfg,
                  'fs_modules': 'fs_plugins.fs.workers' in sys.modules}))
'''.replace('HEAVY', repr(HEAVY))

NATIVE_OPTS = ['federate.total_round_num', '2', 'model.type', 'lr', 'data.type', 'toy']


def run_python(code, *args, **env):
    proc = subprocess.run([sys.executable, '-c', code, *args], env=env_with_tests(**env),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def freeze(outdir, *args) -> dict:
    return json.loads(run_python(FREEZE, str(outdir), *args).strip().splitlines()[-1])


def saved_config(outdir) -> dict:
    with open(outdir / 'config.yaml') as handle:
        return yaml.safe_load(handle)


def test_fs_config_import_loads_neither_transformers_nor_peft():
    code = ('import json, sys; import federatedscope.core.configs.config as c;'
            f'print(json.dumps([[m for m in {HEAVY!r} if m in sys.modules], "fsplug" in c.global_cfg]))')
    heavy, has_node = json.loads(run_python(code).strip().splitlines()[-1])
    assert heavy == [] and has_node   # the plugin is registered, cheaply


def test_native_config_yaml_has_no_fsplug_and_loads_without_the_plugin(tmp_path):
    outdir = tmp_path / 'exp'
    frozen = freeze(outdir, *NATIVE_OPTS)
    assert frozen == {'heavy': [], 'fsplug': False, 'fs_modules': False}
    saved = saved_config(outdir)
    assert 'fsplug' not in saved and saved['federate']['total_round_num'] == 2
    code = ('import sys; from federatedscope.core.configs.config import global_cfg;'
            'assert "fsplug" not in global_cfg; cfg = global_cfg.clone();'
            'cfg.merge_from_file(sys.argv[1]); print(cfg.federate.total_round_num, cfg.model.type)')
    out = run_python(code, str(outdir / 'config.yaml'), FSPLUG_NO_AUTOLOAD='1')
    assert out.strip().splitlines()[-1] == '2 lr'


def test_plugin_config_keeps_its_node(tmp_path):
    cfg_path = write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, 'fedavg', rounds=1, steps=1))
    outdir = tmp_path / 'exp_plugin'
    frozen = freeze(outdir, '--cfg', cfg_path)
    assert frozen['fsplug'] and frozen['fs_modules']   # loaded at the config check, before FS builds
    assert saved_config(outdir)['fsplug']['method'] == 'fedavg'
