"""One reference run per registered method, run once per test process and shared by the suites
that check a finished run instead of each running its own: the method's tiny YAML, 2 rounds of
2 local steps, a checkpoint after every round, in the embedded runner.

Used by tests/test_every_method.py (rows, steps, dtypes), tests/test_artifacts.py (reloaded
models), tests/test_reliability.py (the state round trip) and tests/test_training_scale.py (the
run gradient checkpointing must equal). A test must not change what it gets: the run, its
clients and its server are shared."""
from __future__ import annotations

import os
from dataclasses import dataclass

from helpers import run_embedded_keeping_parties, tiny_yaml_of

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


def options(folder: str, results_dir: str, *extra: str) -> list[str]:
    return ['federate.total_round_num', str(ROUNDS), 'train.local_update_steps', str(LOCAL_STEPS),
            'data.root', os.path.join(folder, 'data'), 'outdir', os.path.join(folder, 'exp'),
            'fsplug.results_dir', results_dir, 'fsplug.checkpoint.freq', '1', *extra]


def load(method: str, results_dir: str, folder: str, *extra: str):
    """The reference config of `method` (a loaded Cfg), results in `results_dir`, the data
    under `folder` (another run of the same config shares the reference's records)."""
    from fs_plugins.run.config import load_config
    return load_config(tiny_yaml_of(method), options(folder, results_dir, *extra))


class ReferenceRuns:
    """The reference runs of one test process, each run when a test first asks for it."""

    def __init__(self, root: str):
        self.root = root
        self._runs: dict[str, ReferenceRun] = {}

    def of(self, method: str) -> ReferenceRun:
        if method not in self._runs:
            folder = os.path.join(self.root, method)
            results_dir = os.path.join(folder, 'results')
            results, clients, server = run_embedded_keeping_parties(load(method, results_dir, folder))
            self._runs[method] = ReferenceRun(method, folder, results, clients, server)
        return self._runs[method]
