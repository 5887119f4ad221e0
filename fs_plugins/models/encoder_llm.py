"""The `imagebind_vicuna` builder: UniFLoW's model (§3.1, Eq. 2-5) — per-modality encoders f_m
(ImageBind in the paper; transformers encoders by default, fs_plugins.models.encoders), a pooling
layer, a trainable linear projection P_m into the LLM's embedding space (Eq. 3), and a
Llama-family causal LM (Vicuna-7B in the paper) that reads the features spliced into its prompt
(Eq. 4):

    [BOS, P_before, ⊕_m X_m, P_gap, question, P_after]  then the answer (the only labels).

P_before / P_gap / P_after are `fsplug.model.multimodal.prompt.*` (the paper's strings by
default); `{modality}` in them becomes the record's modality names joined by ', ' (the paper
writes `<modality>` ... `</modality>` around the features). A record's modalities are its media
fields (`image`, `audio`); each must have an encoder configured. LoRA goes on the language
model (fsplug.model.lora.target_modules) and on each encoder
(fsplug.model.multimodal.<modality>.lora_targets); P trains with fsplug.model.vision
.train_projector (on by default).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.core.registry import MODEL_BUILDERS
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.instruction import IGNORE_INDEX
from fs_plugins.data.multimodal import media_paths
from fs_plugins.models.builders import LoadedBase, TextCodec, register_builder
from fs_plugins.models.codecs import TOKEN_KEYS, Codec, pad_examples
from fs_plugins.models.encoders import load_encoder
from fs_plugins.schema.plugin import EncoderOptions, MultimodalOptions
from fs_plugins.schema.specs import ModelSpec

LANGUAGE_MODEL = 'language_model'
MODALITY_PLACEHOLDER = '{modality}'
PROMPT_PIECES_WITH_PLACEHOLDER = ('before', 'gap')
_MODALITY_PART = re.compile(r'(?:^|\.)(encoders|projectors)\.([^.]+)\.')


def modalities() -> tuple[str, ...]:
    """The modality names: the encoder sections of fsplug.model.multimodal."""
    return tuple(f.name for f in fields(MultimodalOptions)
                 if f.default_factory is EncoderOptions)


def modality_of(name: str) -> str | None:
    """The modality whose encoder (`encoders.<m>.`) or projection (`projectors.<m>.`) parameter
    `name` belongs to; None for the language model's (and any other) parameters."""
    found = _MODALITY_PART.search(name)
    return found.group(2) if found else None


def records_modalities(records) -> tuple[str, ...]:
    """The modalities (media fields) that occur in `records`, in the order of `modalities()`."""
    present = {m for record in records for m in modalities() if record.get(m)}
    return tuple(m for m in modalities() if m in present)


def pool_features(states: torch.Tensor, tokens: int) -> torch.Tensor:
    """Pool(Z) of Eq. 3: average over the sequence down to `tokens` vectors (1: the mean)."""
    if tokens == 1:
        return states.mean(dim=1, keepdim=True)
    return torch.nn.functional.adaptive_avg_pool1d(states.transpose(1, 2), tokens).transpose(1, 2)


class EncoderLLM(torch.nn.Module):
    """Encoders + projections + causal LM. `feature_slots` (batch, seq) marks the prompt
    positions that take modality features: 0 for text, i for the i-th modality of
    `modality_order` (1-based); each input of a modality fills `pool_tokens[m]` slots, in batch
    order."""
    base_model_prefix = ''   # what transformers' weight-conversion lookup (via peft) reads

    def __init__(self, language_model, encoders: dict, pool_tokens: dict[str, int],
                 modality_order: tuple[str, ...]):
        super().__init__()
        self.language_model = language_model
        self.encoders = torch.nn.ModuleDict({m: e.module for m, e in encoders.items()})
        width = language_model.get_input_embeddings().embedding_dim
        self.projectors = torch.nn.ModuleDict(
            {m: torch.nn.Linear(e.hidden_size, width) for m, e in encoders.items()})
        self.input_keys = {m: e.input_key for m, e in encoders.items()}
        self.pool_tokens = dict(pool_tokens)
        self.modality_order = modality_order
        self.config = language_model.config

    def embed(self, input_ids: torch.Tensor, feature_slots: torch.Tensor | None,
              media: dict) -> torch.Tensor:
        """The LLM's input embeddings with every modality's projected features in its slots."""
        embeds = self.language_model.get_input_embeddings()(input_ids)
        if feature_slots is None:
            return embeds
        for index, modality in enumerate(self.modality_order, start=1):
            slots = feature_slots == index
            if not slots.any():
                continue
            projector = self.projectors[modality]
            states = self.encoders[modality](media[self.input_keys[modality]])
            pooled = pool_features(states.to(projector.weight.dtype), self.pool_tokens[modality])
            features = projector(pooled).reshape(-1, embeds.shape[-1])
            if features.shape[0] != int(slots.sum()):
                raise ValueError(f"{modality}: {features.shape[0]} feature vectors for "
                                 f"{int(slots.sum())} prompt slots (inputs "
                                 f"{tuple(media[self.input_keys[modality]].shape)})")
            embeds = embeds.masked_scatter(slots.unsqueeze(-1), features.to(embeds.dtype))
        return embeds

    def _split(self, kwargs: dict) -> tuple[dict, dict]:
        keys = set(self.input_keys.values())
        return ({k: v for k, v in kwargs.items() if k in keys},
                {k: v for k, v in kwargs.items() if k not in keys})

    def forward(self, input_ids=None, attention_mask=None, labels=None, feature_slots=None,
                **kwargs):
        media, rest = self._split(kwargs)
        rest.pop('inputs_embeds', None)
        return self.language_model(inputs_embeds=self.embed(input_ids, feature_slots, media),
                                   attention_mask=attention_mask, labels=labels, **rest)

    @torch.no_grad()
    def generate(self, input_ids=None, attention_mask=None, feature_slots=None, **kwargs):
        """Greedy / configured generation from the spliced prompt; returns the prompt ids
        followed by the new tokens, as a causal LM's generate does."""
        media, rest = self._split(kwargs)
        new = self.language_model.generate(
            inputs_embeds=self.embed(input_ids, feature_slots, media),
            attention_mask=attention_mask, **rest)
        return torch.cat([input_ids, new.to(input_ids.device)], dim=1)

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return self.language_model.prepare_inputs_for_generation(*args, **kwargs)


@dataclass
class EncoderLLMCodec(Codec):
    """Records with media fields -> spliced prompts (Eq. 4) and answer labels."""
    tokenizer: object
    prompt: dict                      # fsplug.model.multimodal.prompt: before / gap / after
    encoders: dict                    # modality -> LoadedEncoder (configured ones)
    pool_tokens: dict
    modality_order: tuple
    max_len: int
    lazy = True

    def record_modalities(self, record: dict) -> list[str]:
        """The record's modalities (its media fields), each with an encoder configured."""
        where = f"Record {record.get('id')}"
        listed = record.get('modalities')
        if listed is not None:
            unknown = sorted(set(listed) - set(self.modality_order))
            if unknown:
                raise ValueError(f"{where}: unknown modality {unknown} in 'modalities'; known: "
                                 f"{list(self.modality_order)}")
        present = [m for m in self.modality_order if record.get(m)]
        for modality in present + list(listed or []):
            if modality not in self.encoders:
                raise ConfigError(f"{where} has {modality} input but no {modality} encoder is "
                                  f"configured (fsplug.model.multimodal.{modality}.backend)")
            if len(media_paths(record, modality)) != 1:
                raise ValueError(f"{where}: one {modality} file per record, got "
                                 f"{media_paths(record, modality)}")
        if not present:
            raise ValueError(f"{where} has no media field ({', '.join(self.encoders)})")
        return present

    def _text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)['input_ids'] if text else []

    def encode_prompt(self, record: dict) -> dict:
        present = self.record_modalities(record)
        tag = ', '.join(present)
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        ids = bos + self._text_ids(self.prompt['before'].replace(MODALITY_PLACEHOLDER, tag))
        slots = [0] * len(ids)
        example = {}
        for modality in present:
            count = self.pool_tokens[modality]
            ids += [self.pad_token_id] * count
            slots += [self.modality_order.index(modality) + 1] * count
            encoder = self.encoders[modality]
            example[encoder.input_key] = encoder.prepare(media_paths(record, modality)[0])
        text = (self.prompt['gap'].replace(MODALITY_PLACEHOLDER, tag)
                + str(record.get('question') or '') + self.prompt['after'])
        ids += self._text_ids(text)
        slots += [0] * (len(ids) - len(slots))
        if len(ids) >= self.max_len:
            raise ValueError(f"Record {record.get('id')}: its prompt takes {len(ids)} tokens "
                             f"(feature slots included), llm.tok_len = {self.max_len} leaves no "
                             f"room for the answer")
        ids = torch.tensor(ids, dtype=torch.long)
        return {'input_ids': ids, 'attention_mask': torch.ones_like(ids),
                'feature_slots': torch.tensor(slots, dtype=torch.long), **example}

    def encode(self, record: dict) -> dict:
        example = self.encode_prompt(record)
        answer = self._text_ids(' ' + str(record['answer']).strip()) + [self.tokenizer.eos_token_id]
        prompt_len = len(example['input_ids'])
        answer = torch.tensor(answer[:self.max_len - prompt_len], dtype=torch.long)
        example['input_ids'] = torch.cat([example['input_ids'], answer])
        example['attention_mask'] = torch.ones_like(example['input_ids'])
        example['feature_slots'] = torch.cat([example['feature_slots'], torch.zeros_like(answer)])
        labels = example['input_ids'].clone()
        labels[:prompt_len] = IGNORE_INDEX
        example['labels'] = labels
        return example

    def _pad(self, examples: list[dict], left: bool) -> dict:
        """Token keys padded; each modality's inputs concatenated over the examples having it."""
        batch = pad_examples([{k: v for k, v in e.items() if k in TOKEN_KEYS} for e in examples],
                             self.pad_token_id, left=left)
        for key in {e.input_key for e in self.encoders.values()}:
            parts = [e[key] for e in examples if key in e]
            if parts:
                batch[key] = torch.cat(parts, dim=0)
        return batch

    def collate(self, examples: list[dict]) -> dict:
        return self._pad(examples, left=False)

    def prompt_batch(self, records: list[dict]) -> dict:
        return self._pad([self.encode_prompt(r) for r in records], left=True)


def check_prompt_pieces(prompt: dict) -> None:
    for piece in PROMPT_PIECES_WITH_PLACEHOLDER:
        if MODALITY_PLACEHOLDER not in prompt[piece]:
            raise ConfigError(f"fsplug.model.multimodal.prompt.{piece} = {prompt[piece]!r} lacks "
                              f"the modality placeholder {MODALITY_PLACEHOLDER} (the paper's "
                              f"<modality> ... </modality> around the features)")


def language_model_base(spec: ModelSpec, path: str) -> LoadedBase:
    """The LLM from fsplug.model.multimodal.llm_builder (a text builder) and model.type."""
    name = spec.model.multimodal.llm_builder
    base = MODEL_BUILDERS.get(name)(spec, path)
    if not isinstance(base.codec, TextCodec):
        raise ConfigError(f"fsplug.model.multimodal.llm_builder = '{name}' is not a text "
                          f"language-model builder (use causal_lm, smollm2 or tiny_llama)")
    return base


@register_builder('imagebind_vicuna')
def load_imagebind_vicuna(spec: ModelSpec, path: str) -> LoadedBase:
    """Encoders + projections + the LLM at model.type; see the module docstring."""
    options = asdict(spec.model.multimodal)
    check_prompt_pieces(options['prompt'])
    order = modalities()
    configured = [m for m in order if options[m]['backend']]
    if not configured:
        raise ConfigError("fsplug.model.builder = 'imagebind_vicuna' needs at least one encoder: "
                          "set fsplug.model.multimodal.<modality>.backend for one of "
                          f"{list(order)}")
    text = language_model_base(spec, path)
    encoders = {m: load_encoder(m, options[m], spec) for m in configured}
    pool_tokens = {m: int(options[m]['pool_tokens']) for m in configured}
    with torch.random.fork_rng(devices=[]):   # the same projections on every client
        torch.manual_seed(derive_seed(spec.seed, 'encoder_llm_projectors'))
        model = EncoderLLM(text.model, encoders, pool_tokens, order)
    codec = EncoderLLMCodec(text.codec.tokenizer, options['prompt'], encoders, pool_tokens,
                            order, int(spec.max_tokens))
    return LoadedBase(model, codec, LANGUAGE_MODEL,
                      {'train_projector': 'projectors.', 'train_tower': 'encoders.'},
                      encoder_lora_targets={f'encoders.{m}.': list(options[m]['lora_targets'])
                                            for m in configured if options[m]['lora_targets']},
                      lora_target_keys={f'encoders.{m}.': f'fsplug.model.multimodal.{m}.lora_targets'
                                        for m in configured},
                      peft_task_type=None)
