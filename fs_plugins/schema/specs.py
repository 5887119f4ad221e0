"""Typed values the layers below the methods receive instead of the whole config.

Models, data, tuners and metrics never see the config tree: they get one of these (or plain
values). `fs_plugins.methods.specs` builds them from a loaded config, in one place."""
from __future__ import annotations

from dataclasses import dataclass, field

from fs_plugins.schema.plugin import DataOptions, ModelOptions

MODEL_TYPE_SEPARATOR = '@'


def location_of(type_value: str) -> str:
    """The location part of FS's `model.type` / `data.type` ('<location>@<suffix>')."""
    return str(type_value).rsplit(MODEL_TYPE_SEPARATOR, 1)[0]


@dataclass(frozen=True)
class DataSource:
    """Where a run's records come from."""
    name: str                      # data.type without its suffix: a file or a builtin dataset
    root: str = 'data'             # data.root
    type_value: str = ''           # data.type as written (for messages)


@dataclass(frozen=True)
class ModelSpec:
    """What building one participant's model needs."""
    path: str                                     # model.type without its suffix
    model: ModelOptions = field(default_factory=ModelOptions)   # fsplug.model
    seed: int = 0
    max_tokens: int = 128                         # llm.tok_len
    prompt: str = 'alpaca'                        # fsplug.data.prompt
    data: DataSource = DataSource('')             # a builder sized by the task (classifier labels)
    use_gpu: bool = False
    device: int = -1
    gradient_checkpointing: bool = False          # fsplug.train.gradient_checkpointing
    type_value: str = ''                          # model.type as written (for messages)


@dataclass(frozen=True)
class SplitSpec:
    """How a run's records become clients."""
    source: DataSource
    splitter: str                                 # data.splitter
    client_num: int                               # federate.client_num
    total_rounds: int                             # federate.total_round_num
    seed: int
    options: DataOptions = field(default_factory=DataOptions)   # fsplug.data
