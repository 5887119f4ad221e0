"""One reference run per registered method, run once per test process and shared by the suites
that check a finished run instead of each running its own: the method's tiny YAML, 2 rounds of
2 local steps, a checkpoint after every round, in the embedded runner.

Used by tests/test_every_method.py (rows, steps, dtypes), tests/test_artifacts.py (reloaded
models), tests/test_reliability.py (the uninterrupted run a resumed one must equal, the state
round trip) and tests/test_training_scale.py (the run gradient checkpointing must equal). A test
must not change what it gets: the run, its clients and its server are shared."""
from __future__ import annotations

import os
from dataclasses import dataclass

from helpers import tiny_yaml_of

ROUNDS = 2
LOCAL_STEPS = 2


@dataclass
class ReferenceRun:
    method: str
    folder: str        # the run's own folder: data/, exp/, results/
    results: object    # fs_plugins.run.results.ResultsLog, closed
    clients: dict      # {client id: ClientProcedure} as the run left them
    server: object     # the ServerProcedure as the run left it

    @property
    def results_dir(self) -> str:
        return os.path.join(self.folder, 'results')

    def options(self, results_dir: str, *extra: str) -> list[str]:
        """The reference's command-line options, with results written to `results_dir`: another
        run of the same config (the data root is shared: the records are the same)."""
        return options(self.folder, results_dir, *extra)


def options(folder: str, results_dir: str, *extra: str, rounds: int = ROUNDS) -> list[str]:
    return ['federate.total_round_num', str(rounds), 'train.local_update_steps', str(LOCAL_STEPS),
            'data.root', os.path.join(folder, 'data'), 'outdir', os.path.join(folder, 'exp'),
            'fsplug.results_dir', results_dir, 'fsplug.checkpoint.freq', '1', *extra]


def load(method: str, results_dir: str, folder: str, *extra: str, rounds: int = ROUNDS):
    """The reference config of `method` (a loaded Cfg), results in `results_dir`."""
    from fs_plugins.run.config import load_config
    return load_config(tiny_yaml_of(method), options(folder, results_dir, *extra, rounds=rounds))


def run_keeping_parties(cfg, client_cfgs=None):
    """The embedded run of `cfg`; returns (results log, {client id: ClientProcedure}, server)."""
    from fs_plugins.sim import runner as runner_mod
    captured, servers = {}, []
    build_clients, server_class = runner_mod.build_clients, runner_mod.ServerProcedure

    def spy_clients(*args, **kwargs):
        captured.update(build_clients(*args, **kwargs))
        return captured

    def spy_server(*args, **kwargs):
        servers.append(server_class(*args, **kwargs))
        return servers[-1]
    runner_mod.build_clients, runner_mod.ServerProcedure = spy_clients, spy_server
    try:
        results = runner_mod.run_embedded(cfg, client_cfgs)
    finally:
        runner_mod.build_clients, runner_mod.ServerProcedure = build_clients, server_class
    return results, captured, servers[-1]


class ReferenceRuns:
    """The reference runs of one test process, each run when a test first asks for it."""

    def __init__(self, root: str):
        self.root = root
        self._runs: dict[str, ReferenceRun] = {}

    def of(self, method: str) -> ReferenceRun:
        if method not in self._runs:
            folder = os.path.join(self.root, method)
            results_dir = os.path.join(folder, 'results')
            results, clients, server = run_keeping_parties(load(method, results_dir, folder))
            self._runs[method] = ReferenceRun(method, folder, results, clients, server)
        return self._runs[method]
