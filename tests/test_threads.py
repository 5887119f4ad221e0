"""torch's thread count and OpenMP's waiting on a shared machine (fs_plugins.core.threads,
docs/running.md "On a shared machine"): the automatic count from the usable cores and the load,
the explicit setting and OMP_NUM_THREADS first, OMP_WAIT_POLICY=PASSIVE in place before torch
starts its OpenMP runtime unless the user chose, and a bad fsplug.threads refused by name."""
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO

from fs_plugins.core.errors import ConfigError
from fs_plugins.core.threads import auto_thread_count, prefer_passive_waiting, thread_count, threads_from_env
from fs_plugins.run.config import load_config
from fs_plugins.run.runtime import use_thread_setting

TINY_YAML = os.path.join(REPO, 'yamls', 'standalone', 'tiny.yaml')


@pytest.mark.parametrize('usable, machine, load, expected', [
    (2, 2, 0.0, 2),      # quiet: every core
    (2, 2, 0.4, 2),      # background noise rounds away
    (2, 2, 1.0, 1),      # one busy neighbour on 2 cores
    (2, 2, 9.5, 1),      # test suites beside: never fewer than 1
    (8, 8, 3.0, 5),
    (2, 64, 30.0, 1),    # 2 of 64 cores: the share of the machine's load on ours is ~0.9
    (4, 64, 4.0, 4),     # 4 busy cores spread over 64: ~0.25 on ours
])
def test_auto_count_is_the_usable_cores_less_the_busy_ones(usable, machine, load, expected):
    assert auto_thread_count(usable, machine, load) == expected


@pytest.mark.parametrize('value, expected', [('3', 3), ('4,2', 4), (' 2 ', 2), ('0', 0), ('x', 0), ('', 0)])
def test_omp_num_threads_is_read_as_openmp_does(value, expected):
    assert threads_from_env({'OMP_NUM_THREADS': value}) == expected


def test_setting_then_omp_num_threads_then_auto():
    assert thread_count(3, {'OMP_NUM_THREADS': '1'}) == 3
    assert thread_count(0, {'OMP_NUM_THREADS': '1'}) == 1
    assert 1 <= thread_count(0, {}) <= len(os.sched_getaffinity(0))


def test_passive_waiting_unless_the_user_chose():
    environ = {}
    prefer_passive_waiting(environ)
    assert environ == {'OMP_WAIT_POLICY': 'PASSIVE'}
    for chosen in ({'OMP_WAIT_POLICY': 'active'}, {'GOMP_SPINCOUNT': '300000'}):
        environ = dict(chosen)
        prefer_passive_waiting(environ)
        assert environ == chosen


def _openmp_settings(**env_changes) -> str:
    """What libgomp reports it read at start-up, in a python that only imports torch (so the
    variable can only come from fs_plugins_autoload.pth)."""
    env = {k: v for k, v in os.environ.items() if k not in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}
    env.update(PYTHONPATH=REPO, OMP_DISPLAY_ENV='VERBOSE', **env_changes)
    done = subprocess.run([sys.executable, '-c', 'import os, torch; torch.ones(1).sum(); '
                           'print("policy", os.environ.get("OMP_WAIT_POLICY"))'],
                          cwd='/', env=env, capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


@pytest.mark.slow
def test_openmp_starts_passive_by_default_and_keeps_the_users_choice():
    import site
    if not any(os.path.exists(os.path.join(d, 'fs_plugins_autoload.pth'))
               for d in site.getsitepackages() + [site.getusersitepackages()]):
        pytest.skip('fs_plugins_autoload.pth is not installed (pip install -e . installs it)')
    assert "GOMP_SPINCOUNT = '0'" in _openmp_settings()        # libgomp's PASSIVE
    chosen = _openmp_settings(OMP_WAIT_POLICY='ACTIVE')
    assert 'policy ACTIVE' in chosen and "GOMP_SPINCOUNT = '0'" not in chosen


def test_bad_thread_setting_is_refused_by_name():
    with pytest.raises(ConfigError, match=r'fsplug\.threads = -1: must be >= 0'):
        load_config(TINY_YAML, ['fsplug.threads', '-1'])
    with pytest.raises(ConfigError, match=r"fsplug\.threads = 'two'"):
        load_config(TINY_YAML, ['fsplug.threads', 'two'])


def test_the_run_applies_the_setting():
    before = torch.get_num_threads()
    try:
        assert use_thread_setting(load_config(TINY_YAML, ['fsplug.threads', '1'])) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
