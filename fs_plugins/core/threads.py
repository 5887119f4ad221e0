"""How many threads torch's CPU ops use, and how OpenMP's idle threads wait, on a machine that
other busy processes share (docs/running.md, "On a shared machine").

torch splits each CPU op over its threads, which meet at a barrier at the op's end. Where
another process keeps one of the cores busy, the thread on that core is descheduled for whole
time slices while the others wait at the barrier, so every op takes about a time slice: fewer
threads than cores are then faster. And by default an idle OpenMP thread spins (libgomp:
GOMP_SPINCOUNT 300000) before it sleeps, taking the core from the neighbour it waits for;
OMP_WAIT_POLICY=PASSIVE makes it sleep at once. Standard library only: `fs_plugins/__init__.py`
calls `prefer_passive_waiting` at interpreter start (through `fs_plugins_autoload.pth`), before
torch loads its OpenMP runtime, which reads the variable only then."""
from __future__ import annotations

import os

WAIT_POLICY_ENV = 'OMP_WAIT_POLICY'
# libgomp's own spin setting: a user who set it chose how threads wait
SPIN_COUNT_ENV = 'GOMP_SPINCOUNT'
THREADS_ENV = 'OMP_NUM_THREADS'


def prefer_passive_waiting(environ=os.environ) -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the user set it or GOMP_SPINCOUNT."""
    if WAIT_POLICY_ENV not in environ and SPIN_COUNT_ENV not in environ:
        environ[WAIT_POLICY_ENV] = 'PASSIVE'


def auto_thread_count(usable_cores: int, machine_cores: int, load: float) -> int:
    """The cores this process may use less those other processes keep busy: the 1-minute load
    average is the whole machine's, so its share on our cores is load × usable / machine
    cores, rounded; at least 1 thread."""
    busy = int(load * usable_cores / max(machine_cores, usable_cores) + 0.5)
    return max(1, usable_cores - busy)


def threads_from_env(environ=os.environ) -> int:
    """OMP_NUM_THREADS's first level (OpenMP allows a list, '4,2'); 0 when unset or not a
    positive number (torch then warns and ignores it too)."""
    first = environ.get(THREADS_ENV, '').split(',')[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else 0


def thread_count(setting: int, environ=os.environ) -> int:
    """torch's intra-op threads for `fsplug.threads`: a positive setting as it is; 0 (auto):
    OMP_NUM_THREADS when set (the user's, or the launcher's share per party), else
    `auto_thread_count` for this process's CPU affinity and the load average now."""
    if setting > 0:
        return setting
    return threads_from_env(environ) or auto_thread_count(
        usable_cores(), os.cpu_count() or 1, os.getloadavg()[0] if hasattr(os, 'getloadavg') else 0.0)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one)."""
    if hasattr(os, 'sched_getaffinity'):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
