"""Sequence-classification builders (RoBERTa on GLUE: UniFLoW §4.2, Table 4) and their codec.

`roberta_classifier` loads `AutoModelForSequenceClassification` + `AutoTokenizer` from a local
folder or hub id (roberta-base, roberta-large); `tiny_roberta_classifier` a tiny random RoBERTa
built offline once (tests, yamls/glue/tiny.yaml). The number of classes and their names come
from the task of data.type (`fs_plugins.data.glue`).

LoRA (rsLoRA, VeRA) goes on fsplug.model.lora.target_modules of the encoder (`query`, `value`
for RoBERTa). The classification head (`classifier`, freshly initialised from the run's seed)
is an ordinary trained module, like a vision-language projector, not peft's `modules_to_save`
(which `TaskType.SEQ_CLS` would force on it: one copy of the head per peft adapter, only one
active at a time, so FedDPA's two active adapters would fail and its 'local' adapter would get
a private head). The peft model is peft's generic `PeftModel` (`LoadedBase.peft_task_type`
None), whose forward is the classifier's own (loss from `labels`). On a half-precision base the
head stays float32, like the adapters (its input is cast up).

Where the head goes (`fsplug.model.head`, `head_stays_local`): with every method the head
trains on each client. 'local' (default) keeps it there: never uploaded, never averaged, and
each client evaluates with its own head over the global adapters. That is UniFLoW's count
(Table 7, RoBERTa-large, LoRA r = 8 on query/value): per-round communicated 0.78M = the LoRA
factors alone (24 layers × 2 modules × 2 × 8 × 1024 = 786,432), trainable 1.83M = those +
the head (dense 1024×1024 + 1024, out_proj 1024×2 + 2: 1,051,650); FFA 1.44M / 0.39M and
FedSA 1.83M / 0.39M likewise leave the head out of the upload. 'shared' uploads the head with
the shared tensors and the method aggregates it (FedAvg, FFA, FedA² beside its A/B pairs,
FedDPA with the global adapter, FedSA with A: its `is_shared` asks `is_task_head`). The
server's global state then holds no trained head (its saved `global/` model is not complete:
`covers_trainable` false), which is why evaluation is on the clients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fs_plugins.core.cache import ensure_cached_dir
from fs_plugins.core.errors import ConfigError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.glue import GLUE_TASKS, label_id, task_of, tiny_corpus
from fs_plugins.models.builders import LoadedBase, from_pretrained, register_builder
from fs_plugins.models.codecs import Codec, pad_examples
from fs_plugins.models.precision import DTYPES
from fs_plugins.models.tiny import train_byte_bpe
from fs_plugins.schema.plugin import HEAD_MODES
from fs_plugins.schema.specs import ModelSpec

# module names of a sequence classifier's head (transformers: `classifier`, or `score` for
# decoder models); their parameters are the task head (fsplug.model.head: local or shared)
HEAD_MODULES = ('classifier', 'score')
# the builders whose models carry such a head (filled by `register_classifier_builder`)
CLASSIFIER_BUILDERS: set[str] = set()
# record fields holding the text, first match wins: GLUE's pair names, Hugging Face's, one sentence
TEXT_FIELDS = (('sentence1', 'sentence2'), ('premise', 'hypothesis'), ('question1', 'question2'),
               ('sentence',))
TINY_DIR_NAME = 'tiny-roberta-v1'
# no dropout: it mostly hides the fixture's cue words from so small a random encoder
TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=258, type_vocab_size=1,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SPECIAL_TOKENS = {'bos_token': '<s>', 'pad_token': '<pad>', 'eos_token': '</s>',
                  'unk_token': '<unk>', 'mask_token': '<mask>'}


def is_task_head(name: str) -> bool:
    """Whether parameter `name` belongs to a classifier's head (HEAD_MODULES)."""
    return any(f'.{module}.' in f'.{name}' for module in HEAD_MODULES)


def head_stays_local(builder: str, head: str) -> bool:
    """Whether a model of builder `builder` keeps its task head on the client
    (fsplug.model.builder, fsplug.model.head): a classifier builder with head 'local'."""
    if head not in HEAD_MODES:
        raise ValueError(f'fsplug.model.head = {head!r}: expected one of {HEAD_MODES}')
    return head == 'local' and builder in CLASSIFIER_BUILDERS


def register_classifier_builder(name: str):
    """register_builder for a builder whose model has a task head (HEAD_MODULES)."""
    CLASSIFIER_BUILDERS.add(name)
    return register_builder(name)


def record_texts(record: dict) -> list[str]:
    """The one or two texts of a classification record (TEXT_FIELDS)."""
    for fields in TEXT_FIELDS:
        if all(f in record for f in fields):
            return [str(record[f]) for f in fields]
    raise ValueError(f"Record {record.get('id', '?')}: no text fields; expected one of "
                     f"{' / '.join('+'.join(f) for f in TEXT_FIELDS)} (it has {sorted(record)})")


def classification_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int, int]:
    """(summed cross-entropy, correct argmax predictions, examples) of one batch."""
    logits = logits.float()
    loss_sum = torch.nn.functional.cross_entropy(logits, labels, reduction='sum').item()
    return loss_sum, int((logits.argmax(-1) == labels).sum()), int(labels.numel())


@dataclass
class ClassificationCodec(Codec):
    """Records {text fields, label} -> input_ids, attention_mask, labels (the class id, from
    the task's label names: the same ids on every client). Evaluation reports the class
    accuracy as <split>_acc and the mean cross-entropy per example as <split>_avg_loss."""
    tokenizer: object
    labels: tuple[str, ...]
    max_len: int
    accuracy_metric = 'acc'

    def encode(self, record: dict) -> dict:
        ids = self.tokenizer(*record_texts(record), truncation=True,
                             max_length=self.max_len)['input_ids']
        ids = torch.tensor(ids, dtype=torch.long)
        label = label_id(record.get('label'), self.labels, f"record {record.get('id', '?')}")
        return {'input_ids': ids, 'attention_mask': torch.ones_like(ids),
                'labels': torch.tensor(label, dtype=torch.long)}

    def collate(self, examples: list[dict]) -> dict:
        batch = pad_examples([{k: v for k, v in e.items() if k != 'labels'} for e in examples],
                             self.pad_token_id)
        batch['labels'] = torch.stack([e['labels'] for e in examples])
        return batch

    def score(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int, int]:
        return classification_stats(logits, labels)

    def loss_units(self, batch: dict) -> int:
        return int(batch['labels'].shape[0])   # the loss is the mean over examples

    def encode_prompt(self, record: dict) -> dict:
        raise ConfigError('fsplug.eval.generate = True: a sequence classifier does not generate '
                          'answers; turn it off (its evaluation reports test_acc)')


# ------------------------------------------------------------------- builders
def task_labels(spec: ModelSpec) -> tuple[str, ...]:
    """The class names of the run's task (data.type must name a GLUE task)."""
    task = task_of(spec.data)
    if task is None:
        raise ConfigError(f"fsplug.model.builder = '{spec.model.builder}' needs a "
                          f"classification task: data.type = 'glue:<task>[:<folder>]@fsplug' "
                          f"(tasks: {', '.join(sorted(GLUE_TASKS))}), not '{spec.data.type_value}'")
    return task.labels


def keep_head_float32(model: torch.nn.Module) -> None:
    """Casts the head to float32 and its input up to it (a half-precision base's hidden states)."""
    for name in HEAD_MODULES:
        head = getattr(model, name, None)
        if head is not None:
            head.float()
            head.register_forward_pre_hook(
                lambda module, args: tuple(a.float() if torch.is_tensor(a) else a for a in args))


@register_classifier_builder('roberta_classifier')
def load_roberta_classifier(spec: ModelSpec, path: str) -> LoadedBase:
    """AutoModelForSequenceClassification + AutoTokenizer (a local folder or a hub id, e.g.
    roberta-large) with one output per class of the run's task; the new head is initialised
    from the run's seed, so every client and the server start from the same one."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    labels = task_labels(spec)
    tokenizer = from_pretrained(AutoTokenizer, path, spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(spec.seed, 'classifier_head'))
        model = from_pretrained(AutoModelForSequenceClassification, path, spec,
                                dtype=DTYPES[spec.model.dtype], num_labels=len(labels),
                                id2label=dict(enumerate(labels)),
                                label2id={name: i for i, name in enumerate(labels)})
    if DTYPES[spec.model.dtype] != torch.float32:
        keep_head_float32(model)
    heads = tuple(name for name in HEAD_MODULES if hasattr(model, name))
    codec = ClassificationCodec(tokenizer, labels, int(spec.max_tokens))
    return LoadedBase(model, codec, peft_task_type=None, trained_modules=heads)


@register_classifier_builder('tiny_roberta_classifier')
def load_tiny_roberta_classifier(spec: ModelSpec, path: str) -> LoadedBase:
    """A tiny random RoBERTa encoder built locally; `path` '' or 'tiny-roberta' uses the cache."""
    return load_roberta_classifier(spec, ensure_tiny_roberta(None if path in ('', 'tiny-roberta')
                                                            else path))


def build_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on the GLUE fixture's words, with RoBERTa's special
    tokens (<pad> = 1 as in RoBERTa) and pair template `<s> A </s></s> B </s>`."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = train_byte_bpe(tiny_corpus(), vocab_size, SPECIAL_TOKENS, add_prefix_space=True)
    tok.post_processor = processors.RobertaProcessing(('</s>', tok.token_to_id('</s>')),
                                                      ('<s>', tok.token_to_id('<s>')))
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=['input_ids', 'attention_mask'],
                                   sep_token='</s>', cls_token='<s>', **SPECIAL_TOKENS)


def build_tiny_roberta_dir(path: str, seed: int = 4321) -> None:
    """Saves a random RoBERTa encoder (no head: the builder adds one per task) + tokenizer."""
    from transformers import RobertaConfig, RobertaModel
    tokenizer = build_tokenizer()
    config = RobertaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           **TINY_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = RobertaModel(config, add_pooling_layer=False)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def ensure_tiny_roberta(path: str | None = None) -> str:
    """The folder of the tiny RoBERTa, built there first if needed."""
    return ensure_cached_dir(path, build_tiny_roberta_dir, TINY_DIR_NAME)
