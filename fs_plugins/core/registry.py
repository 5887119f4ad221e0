"""Named plug-in points (methods, model builders, splitters, metrics, encoders, adapters).

A registry lives here, at the bottom, so that the config schema can offer its names as a key's
allowed values without importing the packages that fill it: the owning package registers its
entries on import and tells the registry how to find the rest (`discover_with`, usually "import
every module of my package"). The config loader (`fs_plugins.run.config`) imports the owners,
so a loaded config always sees complete registries."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from fs_plugins.core.errors import ConfigError, closest_spelling


class Registry:
    """name -> entry, for one kind of plug-in; `key` is the config key that selects one."""

    def __init__(self, kind: str, key: str):
        self.kind = kind
        self.key = key
        self._entries: dict[str, object] = {}
        self._discover: Callable[[], None] | None = None
        self._discovered = False

    def discover_with(self, discover: Callable[[], None]) -> None:
        """`discover()` imports whatever registers the owner's entries; run once, on first use."""
        self._discover = discover
        self._discovered = False

    def _complete(self) -> dict[str, object]:
        if self._discover is not None and not self._discovered:
            self._discovered = True
            self._discover()
        return self._entries

    def registered(self, name: str):
        """The entry registered so far under `name` (None), without discovering the rest."""
        return self._entries.get(name)

    def add(self, name: str, entry: object) -> None:
        self._entries[name] = entry

    def register(self, name: str):
        """Decorator: `@REGISTRY.register('name')` adds the decorated object under `name`."""
        def wrap(entry):
            self.add(name, entry)
            return entry
        return wrap

    def names(self) -> list[str]:
        return sorted(self._complete())

    def items(self) -> Iterator[tuple[str, object]]:
        return iter(sorted(self._complete().items()))

    def get(self, name: str):
        entries = self._complete()
        if name not in entries:
            close = closest_spelling(name, entries)
            hint = f" (did you mean '{close}'?)" if close else ''
            raise ConfigError(f"{self.key} = '{name}' is not a known {self.kind}{hint}; "
                              f"allowed: {', '.join(sorted(entries))}")
        return entries[name]

    def __contains__(self, name) -> bool:
        return name in self._complete()


METHODS = Registry('method', 'fsplug.method')
MODEL_BUILDERS = Registry('model builder', 'fsplug.model.builder')
ADAPTERS = Registry('adapter', 'fsplug.model.adapter')
ENCODER_BACKENDS = Registry('encoder backend', 'fsplug.model.multimodal.<modality>.backend')
SPLITTERS = Registry('splitter', 'data.splitter')
GENERATION_METRICS = Registry('generation metric', 'fsplug.eval.gen_metrics')
# metrics every evaluation reports besides the loss: name -> larger is better
REPORTED_METRICS = Registry('reported metric', 'eval.best_res_update_round_wise_key')
