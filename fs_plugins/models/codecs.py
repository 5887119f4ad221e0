"""How records become model inputs, one codec per kind of model.

A codec turns a record into a training example (loss only on answer tokens), pads a list of
examples into a batch, builds left-padded prompt batches for generation and decodes generated
ids. `TextCodec` serves causal LMs on instruction records; `MultimodalCodec` serves LLaVA-style
and Qwen2-VL models on the normalised multimodal records (`fs_plugins.data.multimodal`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fs_plugins.data.instruction import IGNORE_INDEX, format_prompt, tokenize_record
from fs_plugins.data.multimodal import open_images
from fs_plugins.metrics.token import answer_token_stats

logger = logging.getLogger(__name__)

# Prompt formats: {images} is one placeholder per image, {question} the record's question.
LLAVA15_PROMPT = 'USER: {images}{question} ASSISTANT:'
LLAVA_IMAGE = '<image>\n'
QWEN2VL_PROMPT = ('<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'
                  '<|im_start|>user\n{images}{question}<|im_end|>\n<|im_start|>assistant\n')
QWEN2VL_IMAGE = '<|vision_start|><|image_pad|><|vision_end|>'

# batch keys padded along the token axis, with their padding value (None: the pad token id)
TOKEN_KEYS = {'input_ids': None, 'labels': IGNORE_INDEX, 'attention_mask': 0,
              'mm_token_type_ids': 0, 'feature_slots': 0}


def pad_examples(examples: list[dict], pad_token_id: int, left: bool = False) -> dict:
    """Pads per-token tensors (right for training, left for generation) and concatenates
    per-image tensors (pixel_values, image_grid_thw) along their first axis."""
    length = max(len(e['input_ids']) for e in examples)
    batch = {}
    for key in examples[0]:
        values = [e[key] for e in examples]
        if key in TOKEN_KEYS:
            fill = pad_token_id if TOKEN_KEYS[key] is None else TOKEN_KEYS[key]
            out = torch.full((len(values), length), fill, dtype=values[0].dtype)
            for row, value in enumerate(values):
                if left:
                    out[row, length - len(value):] = value
                else:
                    out[row, :len(value)] = value
            batch[key] = out
        else:
            batch[key] = torch.cat(values, dim=0)
    return batch


class Codec:
    """Interface; subclasses provide `tokenizer`, the text tokenizer (pad/eos ids, decoding)."""
    lazy = False   # True: encode when a batch is drawn (images are not kept in memory)
    # evaluation reports <split>_<accuracy_metric> from `score` (fs_plugins.metrics)
    accuracy_metric = 'token_acc'

    def encode(self, record: dict) -> dict | None:
        raise NotImplementedError

    def score(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int, int]:
        """(summed loss, correct predictions, predictions) of one evaluation batch: here the
        answer tokens' next-token predictions (a classifier's codec scores its classes)."""
        return answer_token_stats(logits, labels)

    def loss_units(self, batch: dict) -> int:
        """How many terms the training loss of `batch` averages: its answer tokens after the
        causal shift (gradient accumulation weighs micro-batches by it)."""
        return int((batch['labels'][:, 1:] != IGNORE_INDEX).sum())

    def encode_prompt(self, record: dict) -> dict:
        raise NotImplementedError

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def stop_token_id(self) -> int:
        """Generation stops at this token (the end of an answer)."""
        return self.tokenizer.eos_token_id

    def collate(self, examples: list[dict]) -> dict:
        return pad_examples(examples, self.pad_token_id)

    def prompt_batch(self, records: list[dict]) -> dict:
        return self.pad_prompts([self.encode_prompt(r) for r in records])

    def pad_prompts(self, prompts: list[dict]) -> dict:
        """A generation batch of encoded prompts (`encode_prompt`'s), left-padded."""
        return pad_examples(prompts, self.pad_token_id, left=True)

    def prompt_of(self, record: dict, example: dict) -> dict:
        """`encode_prompt(record)`, given `example`, the record's encoded example (a codec
        whose examples begin with their prompt cuts it out instead of encoding again)."""
        return self.encode_prompt(record)

    def decode(self, ids: torch.Tensor) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


@dataclass
class TextCodec(Codec):
    tokenizer: object
    template: str
    max_len: int

    def encode(self, record: dict) -> dict | None:
        example = tokenize_record(record, self.tokenizer, self.template, self.max_len)
        if example is not None:
            example['attention_mask'] = torch.ones_like(example['input_ids'])
        return example

    def encode_prompt(self, record: dict) -> dict:
        ids = self.tokenizer(format_prompt(record, self.template),
                             add_special_tokens=True)['input_ids'][-self.max_len:]
        ids = torch.tensor(ids, dtype=torch.long)
        return {'input_ids': ids, 'attention_mask': torch.ones_like(ids)}


@dataclass
class MultimodalCodec(Codec):
    """Records with images: the processor expands image placeholders and prepares pixels;
    the answer (plus `end_text`) is appended as tokens so labels cover exactly the answer."""
    processor: object
    prompt_format: str
    image_placeholder: str
    end_text: str
    max_len: int
    answer_prefix: str = ' '
    lazy = True

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def stop_token_id(self) -> int:
        end_id = self.tokenizer.convert_tokens_to_ids(self.end_text) if self.end_text else None
        return end_id if end_id is not None else self.tokenizer.eos_token_id

    def prompt_text(self, record: dict) -> str:
        if not record.get('image') or record.get('audio'):
            raise ValueError(f"Record {record.get('id')}: this vision-language model takes "
                             f"records with an image and no audio (fields: {sorted(record)}); "
                             f"audio needs fsplug.model.builder: imagebind_vicuna")
        n_images = 1 if isinstance(record['image'], str) else len(record['image'])
        return self.prompt_format.format(images=self.image_placeholder * n_images,
                                         question=record['question'])

    def encode_prompt(self, record: dict) -> dict:
        encoded = self.processor(images=open_images(record), text=[self.prompt_text(record)],
                                 return_tensors='pt')
        example = {k: (v[0] if k in TOKEN_KEYS else v) for k, v in encoded.items()}
        if len(example['input_ids']) >= self.max_len:
            raise ValueError(f"Record {record.get('id')}: its prompt takes "
                             f"{len(example['input_ids'])} tokens (image tokens included), "
                             f"llm.tok_len = {self.max_len} leaves no room for the answer")
        return example

    def prompt_of(self, record: dict, example: dict) -> dict:
        """The prompt part of `example` (`encode` appends the answer to `encode_prompt`'s
        output), so the images are not processed again."""
        length = int((example['labels'] == IGNORE_INDEX).sum())
        return {key: value[:length] if key in TOKEN_KEYS else value
                for key, value in example.items() if key != 'labels'}

    def encode(self, record: dict) -> dict:
        example = self.encode_prompt(record)
        answer = self.tokenizer(self.answer_prefix + str(record['answer']).strip() + self.end_text,
                                add_special_tokens=False, return_tensors='pt')['input_ids'][0]
        answer = answer[:self.max_len - len(example['input_ids'])]
        prompt_len = len(example['input_ids'])
        example['input_ids'] = torch.cat([example['input_ids'], answer])
        example['attention_mask'] = torch.ones_like(example['input_ids'])
        if 'mm_token_type_ids' in example:
            example['mm_token_type_ids'] = torch.cat(
                [example['mm_token_type_ids'], torch.zeros_like(answer)])
        labels = example['input_ids'].clone()
        labels[:prompt_len] = IGNORE_INDEX
        example['labels'] = labels
        return example


class EncodedDataset(torch.utils.data.Dataset):
    """A client's examples. Text records are encoded once, dropping those whose answer does
    not fit (with a warning); multimodal records are encoded when drawn, so image tensors are
    never all held in memory."""

    def __init__(self, records: list[dict], codec: Codec, where: str):
        self.codec = codec
        if codec.lazy:
            self.records, self.examples = list(records), None
            return
        kept = [(r, codec.encode(r)) for r in records]
        kept = [(r, e) for r, e in kept if e is not None]
        if len(kept) < len(records):
            logger.warning(f"{where}: dropped {len(records) - len(kept)} record(s) whose answer "
                           f"does not fit in llm.tok_len = {codec.max_len} tokens")
        self.records = [r for r, _ in kept]
        self.examples = [e for _, e in kept]

    def subset(self, keep) -> EncodedDataset:
        """The examples whose record satisfies keep(record), already encoded ones reused."""
        return self.subset_at([i for i, record in enumerate(self.records) if keep(record)])

    def subset_at(self, indices: list[int]) -> EncodedDataset:
        """The examples at `indices`, already encoded ones reused."""
        part = object.__new__(EncodedDataset)
        part.codec, part.records = self.codec, [self.records[i] for i in indices]
        part.examples = None if self.examples is None else [self.examples[i] for i in indices]
        return part

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        if self.examples is None:
            return self.codec.encode(self.records[idx])
        return self.examples[idx]
