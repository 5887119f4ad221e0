"""Composing a library of existing, frozen LoRA adapters (SmartFed and its LoRA-reuse
baselines), in peft's tuner layout:

- `adapters`: reading and checking peft adapter folders (`load_library`, `stacked_factors`);
- `layers`: the composition layers — `RankWiseExperts` (MoRE, sparse top-q rank-1 experts via
  `rank_one_mixture`), `MergedLora`, `LoraGate` (MoLE), `FlowMixture` + `FlowGate` (LoRA-Flow);
- `model`: `attach_library` / `attach_flow_gates`, which put them on the model;
- `builtin`: library adapters made here for tests and the tiny demo.
"""
from fs_plugins.tuners.library.adapters import LibraryAdapter, load_library, stacked_factors, target_modules
from fs_plugins.tuners.library.layers import (
                                                LIBRARY_ATTR,
                                                FlowGate,
                                                FlowMixture,
                                                LoraGate,
                                                MergedLora,
                                                RankWiseExperts,
                                                dense_rank_mixture,
                                                rank_one_mixture,
)
from fs_plugins.tuners.library.model import attach_flow_gates, attach_library, decoder_layer_of

__all__ = ['LibraryAdapter', 'load_library', 'stacked_factors', 'target_modules', 'LIBRARY_ATTR',
           'FlowGate', 'FlowMixture', 'LoraGate', 'MergedLora', 'RankWiseExperts',
           'dense_rank_mixture', 'rank_one_mixture', 'attach_flow_gates', 'attach_library',
           'decoder_layer_of']
