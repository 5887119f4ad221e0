"""Typed values the layers below the methods receive instead of the whole config.

Models, data, tuners and metrics never see the config tree: they get one of these (or plain
values). `fs_plugins.methods.specs` builds them from a loaded config, in one place."""
from __future__ import annotations

from dataclasses import dataclass, field

from fs_plugins.schema.plugin import FS_LLM_DATA_SUFFIX, DataOptions, ModelOptions

MODEL_TYPE_SEPARATOR = '@'


def location_of(type_value: str) -> str:
    """The location part of FS's `model.type` / `data.type` ('<location>@<suffix>')."""
    return str(type_value).rsplit(MODEL_TYPE_SEPARATOR, 1)[0]


def suffix_of(type_value: str) -> str:
    """The suffix part of FS's `model.type` / `data.type` ('' when there is none)."""
    location, separator, suffix = str(type_value).rpartition(MODEL_TYPE_SEPARATOR)
    return suffix if separator else ''


@dataclass(frozen=True)
class DataSource:
    """Where a run's records come from."""
    name: str                      # data.type without its suffix: a file or a named dataset
    root: str = 'data'             # data.root
    type_value: str = ''           # data.type as written: its suffix says whose data it is
    subsample: float = 1.0         # data.subsample (FS-LLM's code_search_net)

    @property
    def is_fs_llm(self) -> bool:
        """FS-LLM's data ('<name>@llm'): its named datasets and its reading of record files
        (fs_plugins.data.fs_llm)."""
        return suffix_of(self.type_value) == FS_LLM_DATA_SUFFIX

    @property
    def own_prompt(self) -> str:
        """The prompt template of this source's records (fsplug.data.prompt = '')."""
        return 'fs_llm' if self.is_fs_llm else 'alpaca'


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
    public_holdout: int = 0   # training records held apart as the public set (data.public)
