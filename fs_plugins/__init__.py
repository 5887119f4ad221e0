"""fs-plugins: federated LoRA methods as FederatedScope-LLM plugins.

Importing this package is cheap (no torch, no FederatedScope); the FS binding is loaded by the
import hook in `fs_plugins.fs.autoload` when FederatedScope's config module is imported.
Importing it sets OMP_WAIT_POLICY=PASSIVE unless the user chose how OpenMP threads wait
(`fs_plugins.core.threads`)."""
from fs_plugins.core.threads import prefer_passive_waiting

__version__ = '0.1.0'

__all__ = ['load_trained']

# before torch loads its OpenMP runtime (this runs at interpreter start, from
# fs_plugins_autoload.pth): idle threads sleep instead of spinning on a neighbour's core
prefer_passive_waiting()


def load_trained(run_dir: str, client=None, device: str = 'cpu', import_modules=()):
    """A run's trained model rebuilt from its results directory (see fs_plugins.run.artifacts);
    `import_modules`: modules to trust and import first (the saved config's are not imported)."""
    from fs_plugins.run.artifacts import load_trained as load  # lazy: `import fs_plugins` stays cheap
    return load(run_dir, client, device, import_modules)
