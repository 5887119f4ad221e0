"""RELA's batches for a W_s whose tokenizer is not the client's (paper A.20, Table 31: a
LLaVA-Qwen-0.5B W_s for LLaVA-Llama clients).

W_s is the same model for every client (A.6: "to maintain gradient dimension consistency"), so
its gradients compare across clients whatever the clients' own vocabularies; it only has to
read the same samples. A client batch holds token ids (and pixels) of the client's codec, not
its records, so each of its rows is traced back to the record it was encoded from: the client's
training records are indexed by a digest of their client encoding (token ids, labels, and any
per-image tensor), and the row's digest looks its record up. W_s's batch is then those records
encoded by W_s's own codec (its tokenizer, prompt format and image processor), in the row
order: the same samples, deterministically. A record whose answer does not fit W_s's token
limit is left out of W_s's batch (ours; the paper's models share one limit).

Building the index encodes each training record once with the client's codec (for a
multimodal codec: its images once), on the first batch that needs it.
"""
from __future__ import annotations

import hashlib

import torch

from fs_plugins.models.codecs import TOKEN_KEYS

__all__ = ['RecordIndex', 'rows_of', 'encode_for']


def _digest(tensors: list[torch.Tensor]) -> str:
    sha = hashlib.sha1()
    for tensor in tensors:
        t = tensor.detach().to('cpu').contiguous()
        sha.update(str((t.dtype, tuple(t.shape))).encode())
        sha.update(t.numpy().tobytes())
    return sha.hexdigest()


def _token_digest(example: dict) -> str:
    return _digest([example['input_ids'], example['labels']])


def rows_of(batch: dict) -> list[dict]:
    """The per-row token tensors of a right-padded training batch (`codecs.pad_examples`), each
    cut to the row's attention mask."""
    lengths = batch['attention_mask'].sum(dim=1).tolist()
    return [{k: batch[k][row, :int(length)] for k in batch if k in TOKEN_KEYS}
            for row, length in enumerate(lengths)]


class RecordIndex:
    """A client's training records by the digest of their client encoding."""

    def __init__(self, records: list[dict], codec, where: str):
        self.where = where
        self.by_tokens: dict[str, list[tuple[int, dict[str, int], str]]] = {}
        self.records = records
        for index, record in enumerate(records):
            example = codec.encode(record)
            if example is None:          # the client drops it too (answer does not fit)
                continue
            images = {k: v for k, v in example.items() if k not in TOKEN_KEYS}
            counts = {k: int(v.shape[0]) for k, v in images.items()}
            entry = (index, counts, _digest([images[k] for k in sorted(images)]))
            self.by_tokens.setdefault(_token_digest(example), []).append(entry)

    def records_of(self, batch: dict) -> list[dict]:
        """The records the rows of client `batch` were encoded from, in row order."""
        texts = rows_of(batch)
        image_keys = sorted(k for k in batch if k not in TOKEN_KEYS)
        offsets = dict.fromkeys(image_keys, 0)
        found = []
        for row, example in enumerate(texts):
            candidates = self.by_tokens.get(_token_digest(example), [])
            match = next((c for c in candidates
                          if self._images_match(batch, image_keys, offsets, c)), None)
            if match is None:
                raise ValueError(f'{self.where}: row {row} of the batch is none of the '
                                 f"client's training records ({len(candidates)} with its tokens)")
            index, counts, _ = match
            for key in image_keys:
                offsets[key] += counts[key]
            found.append(self.records[index])
        return found

    @staticmethod
    def _images_match(batch, image_keys, offsets, candidate) -> bool:
        _, counts, digest = candidate
        if sorted(counts) != image_keys:
            return False
        if any(offsets[k] + counts[k] > batch[k].shape[0] for k in image_keys):
            return False
        return digest == _digest([batch[k][offsets[k]:offsets[k] + counts[k]] for k in image_keys])


def encode_for(codec, records: list[dict]) -> dict | None:
    """`records` as one batch of `codec` (W_s's), those that do not fit left out; None if none."""
    examples = [e for e in (codec.encode(r) for r in records) if e is not None]
    return codec.collate(examples) if examples else None
