"""A loaded config turned into the typed values the layers below receive (`fs_plugins.schema.specs`):
the one place where config keys become a model spec, a data source or a split spec."""
from __future__ import annotations

import torch

from fs_plugins.data.public import HELD_OUT, PUBLIC_OPTIONS
from fs_plugins.schema.options import build, to_plain
from fs_plugins.schema.plugin import DataOptions, ModelOptions
from fs_plugins.schema.specs import DataSource, ModelSpec, SplitSpec, location_of


def device_for(cfg) -> str:
    if cfg.use_gpu and torch.cuda.is_available():
        return f'cuda:{max(int(cfg.device), 0)}'
    return 'cpu'


def data_source(cfg) -> DataSource:
    # data.subsample is FS's key (FS-LLM's code_search_net); the embedded runner may lack it
    subsample = float(cfg.data.get('subsample', 1.0))
    return DataSource(location_of(cfg.data.type), str(cfg.data.root), str(cfg.data.type),
                      subsample)


def prompt_template(cfg) -> str:
    """fsplug.data.prompt, '' resolved to the data source's own template."""
    return str(cfg.fsplug.data.prompt) or data_source(cfg).own_prompt


def model_spec(cfg) -> ModelSpec:
    return ModelSpec(path=location_of(cfg.model.type),
                     model=build(ModelOptions, to_plain(cfg.fsplug.model)),
                     seed=int(cfg.seed), max_tokens=int(cfg.llm.tok_len),
                     prompt=prompt_template(cfg), data=data_source(cfg),
                     use_gpu=bool(cfg.use_gpu), device=int(cfg.device),
                     gradient_checkpointing=bool(cfg.fsplug.train.gradient_checkpointing),
                     type_value=str(cfg.model.type))


def split_spec(cfg) -> SplitSpec:
    return SplitSpec(source=data_source(cfg), splitter=str(cfg.data.splitter),
                     client_num=int(cfg.federate.client_num),
                     total_rounds=int(cfg.federate.total_round_num), seed=int(cfg.seed),
                     options=build(DataOptions, to_plain(cfg.fsplug.data)),
                     public_holdout=public_holdout_count(cfg))


def public_holdout_count(cfg) -> int:
    """Training records the run holds apart from its clients: fsplug.data.public_holdout, else
    the count of the method's public_data when its source is HELD_OUT (0: none)."""
    configured = int(cfg.fsplug.data.public_holdout)
    if configured:
        return configured
    node = getattr(cfg.fsplug, str(cfg.fsplug.method), None)
    source_key, count_key = PUBLIC_OPTIONS[0]
    if node is not None and source_key in node and node[source_key] == HELD_OUT:
        return int(node[count_key])
    return 0
