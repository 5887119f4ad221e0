"""fs-plugins: federated LoRA methods as FederatedScope-LLM plugins.

Importing this package is cheap (no torch, no FederatedScope); the FS binding is loaded by the
import hook in `fs_plugins.fs.autoload` when FederatedScope's config module is imported."""
__version__ = '0.1.0'
