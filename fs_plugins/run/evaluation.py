"""Per-client evaluation: answer-token loss / accuracy (`token_metrics`) and the metrics of
greedy answers (`generation_metrics`), together in `evaluation_metrics`.

With fsplug.eval.shared_prefill, a record that is generated pays for its prompt once: `generate`
fills a kept KV cache with the prompt batch and decodes the answers; the cache is cropped back to
the prompt and continued with the teacher-forced reference answer, whose logits (with the
prompt's last ones, which `generate` returns) give the answer-token metrics, with no second pass
over the prompt and its image. The other records get the plain forward over their examples."""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import time

import torch

from fs_plugins.data.instruction import IGNORE_INDEX
from fs_plugins.data.multimodal import reference_answer
from fs_plugins.metrics.generation_metrics import GENERATION_METRICS, configure_generation_metrics
from fs_plugins.models.codecs import TOKEN_KEYS, pad_examples

logger = logging.getLogger(__name__)

EVAL_TIME_KEYS = ('eval', 'prefill', 'generate')
TokenStats = tuple[float, int, int]   # (summed loss, correct predictions, scored units)


class EvalTimes:
    """Seconds spent evaluating, by part: 'eval' (all of it), 'prefill' (the forward passes
    over prompts and examples, the generation's prompt pass included) and 'generate' (decoding
    the new tokens)."""

    def __init__(self):
        self.seconds = dict.fromkeys(EVAL_TIME_KEYS, 0.0)

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    @contextlib.contextmanager
    def timing(self, part: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - started)

    def take(self) -> dict:
        """{'eval_s', 'eval_prefill_s', 'eval_generate_s'} accumulated so far; then resets."""
        taken = {'eval_s' if part == 'eval' else f'eval_{part}_s': seconds
                 for part, seconds in self.seconds.items()}
        self.seconds = dict.fromkeys(EVAL_TIME_KEYS, 0.0)
        return taken


class _PrefillClock:
    """A stopping criterion that never stops: its first call comes right after `generate`'s
    pass over the prompt, which splits the call's time into prefill and decoding."""

    def __init__(self, times: EvalTimes, started: float, device: torch.device):
        self.times, self.started, self.device = times, started, device
        self.prefilled = None

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        if self.prefilled is None:
            if self.device.type == 'cuda':
                torch.cuda.synchronize(self.device)
            self.prefilled = time.perf_counter()
            self.times.add('prefill', self.prefilled - self.started)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def finish(self) -> None:
        end = time.perf_counter()
        self.times.add('prefill' if self.prefilled is None else 'generate',
                       end - (self.prefilled or self.started))


# ----------------------------------------------------------------------- groups
def modality_groups(dataset) -> dict[str, list[int]]:
    """{label: record indices} of an evaluation set whose records have different input
    modalities ('image', 'audio', 'image+audio': the modalities each record feeds the model,
    as its codec reads them), so each is also scored apart (UniFLoW's Tables 1-3 test every
    modality separately), whenever the model has encoders of several modalities or the set
    mixes kinds; {} for a codec without media."""
    read = getattr(dataset.codec, 'record_modalities', None)
    if read is None:
        return {}
    groups: dict[str, list[int]] = {}
    for index, record in enumerate(dataset.records):
        groups.setdefault('+'.join(read(record)) or 'text', []).append(index)
    several = len(getattr(dataset.codec, 'modality_order', ())) > 1
    return groups if len(groups) > 1 or several else {}


def generated_indices(count: int, cap: int, groups: dict[str, list[int]]) -> list[int]:
    """The records that get answers: the first `cap` (fsplug.eval.max_gen_samples, 0 = all),
    per group when there are groups (each test modality gets answers), in record order."""
    if groups:
        return sorted(i for indices in groups.values() for i in indices[:cap or len(indices)])
    return list(range(min(cap or count, count)))


# ---------------------------------------------------------------- the whole pass
def evaluation_metrics(model, dataset, eval_cfg, batch_size: int, split: str, device='cpu',
                       predictions: tuple | None = None, groups: dict[str, list[int]] | None = None,
                       times: EvalTimes | None = None) -> dict:
    """`token_metrics` of every record, plus, with fsplug.eval.generate, `generation_metrics`;
    with fsplug.eval.shared_prefill the generated records' token metrics come from their
    generation's prompt pass (the numbers are the same)."""
    times = times or EvalTimes()
    groups = groups or {}
    stats: dict[int, TokenStats] = {}
    if eval_cfg.generate:
        chosen = generated_indices(len(dataset), eval_cfg.max_gen_samples, groups)
        if eval_cfg.shared_prefill and continues_cache(model):
            answers, stats = shared_prefill_answers(model, dataset, chosen, batch_size,
                                                    eval_cfg.max_new_tokens, device, times)
        else:
            answers = generate_answers(model, dataset.codec, [dataset.records[i] for i in chosen],
                                       batch_size, eval_cfg.max_new_tokens, device, times)
    with times.timing('prefill'):
        for indices in _parts(len(dataset), groups):
            stats.update(record_token_stats(model, dataset, [i for i in indices if i not in stats],
                                            batch_size, device))
    results = _grouped_token_results(dataset, split, stats, groups)
    if eval_cfg.generate:
        results.update(_scored_answers(dataset.records, chosen, answers, eval_cfg, split,
                                       predictions, groups))
    return results


def _parts(count: int, groups: dict[str, list[int]]) -> list[list[int]]:
    return list(groups.values()) if groups else [list(range(count))]


# ---------------------------------------------------------------- token metrics
def token_metrics(model, dataset, collate, batch_size: int, split: str, device='cpu',
                  groups: dict[str, list[int]] | None = None) -> dict:
    """Loss and accuracy of `model` on an encoded dataset as its codec scores them: answer
    tokens and next-token accuracy (<split>_token_acc) for text, the class per example for a
    classifier (<split>_acc). With `groups` ({label: record indices}) also each group's, as
    <split>_<label>_*, from the same forward passes (the whole set's are their sums).
    `collate` is the dataset's codec's (kept for callers that pass it)."""
    groups = groups or {}
    stats: dict[int, TokenStats] = {}
    for indices in _parts(len(dataset), groups):
        stats.update(record_token_stats(model, dataset, indices, batch_size, device, collate))
    return _grouped_token_results(dataset, split, stats, groups)


def record_token_stats(model, dataset, indices: list[int], batch_size: int, device,
                       collate=None) -> dict[int, TokenStats]:
    """{index: (loss sum, correct, scored units)} of the examples at `indices`, from one
    forward pass per batch of `batch_size` of them, as their codec scores them."""
    codec, collate = dataset.codec, collate or dataset.codec.collate
    stats = {}
    for start in range(0, len(indices), batch_size):
        chunk = indices[start:start + batch_size]
        batch = collate([dataset[i] for i in chunk])
        labels = batch.pop('labels')
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.cpu()
        stats.update({index: codec.score(logits[row:row + 1], labels[row:row + 1])
                      for row, index in enumerate(chunk)})
    return stats


def _grouped_token_results(dataset, split: str, stats: dict[int, TokenStats],
                           groups: dict[str, list[int]]) -> dict:
    codec = dataset.codec
    results = _token_results(codec, split, _summed(stats.values()), len(dataset))
    for label, indices in groups.items():
        results.update(_token_results(codec, f'{split}_{label}',
                                      _summed(stats[i] for i in indices), len(indices)))
    return results


def _summed(stats) -> TokenStats:
    loss_sum, correct, count = 0.0, 0, 0
    for loss, right, units in stats:
        loss_sum, correct, count = loss_sum + loss, correct + right, count + units
    return loss_sum, correct, count


def _token_results(codec, prefix: str, stats: TokenStats, count: int) -> dict:
    loss_sum, correct, units = stats
    return {f'{prefix}_avg_loss': loss_sum / max(units, 1),
            f'{prefix}_{codec.accuracy_metric}': correct / max(units, 1),
            f'{prefix}_total': count}


# ------------------------------------------------------------------- generation
def generation_metrics(model, codec, records: list[dict], eval_cfg, batch_size: int, split: str,
                       device='cpu', predictions: tuple | None = None,
                       groups: dict[str, list[int]] | None = None) -> dict:
    """fsplug.eval.gen_metrics of greedy answers to the first fsplug.eval.max_gen_samples
    records; predictions=(path, client id) also writes the answers there. With `groups`
    ({label: record indices}) the cap applies per group (each test modality gets answers)
    and the same answers are also scored per group, as <split>_<label>_<metric>."""
    groups = groups or {}
    chosen = generated_indices(len(records), eval_cfg.max_gen_samples, groups)
    answers = generate_answers(model, codec, [records[i] for i in chosen], batch_size,
                               eval_cfg.max_new_tokens, device)
    return _scored_answers(records, chosen, answers, eval_cfg, split, predictions, groups)


def _scored_answers(records: list[dict], chosen: list[int], answers: list[str], eval_cfg,
                    split: str, predictions: tuple | None, groups: dict[str, list[int]]) -> dict:
    answered = [records[i] for i in chosen]
    references = [reference_answer(r) for r in answered]
    if predictions:
        write_predictions(predictions[0], predictions[1], answered, answers)
    configure_generation_metrics(eval_cfg)
    position = {index: k for k, index in enumerate(chosen)}
    scored = {split: list(range(len(answered)))}
    for label, indices in groups.items():
        scored[f'{split}_{label}'] = [position[i] for i in indices if i in position]
    return {f'{prefix}_{name}': GENERATION_METRICS[name]([answers[k] for k in kept],
                                                         [references[k] for k in kept])
            for prefix, kept in scored.items() if kept for name in eval_cfg.gen_metrics}


def _generation_config(codec, max_new_tokens: int, keep_cache: bool = False):
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                            pad_token_id=codec.pad_token_id, eos_token_id=codec.stop_token_id,
                            return_dict_in_generate=keep_cache, output_logits=keep_cache)


def _generate(model, batch: dict, config, device, times: EvalTimes | None):
    """model.generate on `batch`, its time split into prefill and decoding when timed."""
    if times is None:
        return model.generate(**batch, generation_config=config)
    from transformers import StoppingCriteriaList
    clock = _PrefillClock(times, time.perf_counter(), torch.device(device))
    try:
        return model.generate(**batch, generation_config=config,
                              stopping_criteria=StoppingCriteriaList([clock]))
    finally:
        clock.finish()


def generate_answers(model, codec, records: list[dict], batch_size: int, max_new_tokens: int,
                     device='cpu', times: EvalTimes | None = None) -> list[str]:
    """Greedy answers, `batch_size` left-padded prompts at a time."""
    config = _generation_config(codec, max_new_tokens)
    answers = []
    for start in range(0, len(records), batch_size):
        batch = codec.prompt_batch(records[start:start + batch_size])
        batch = {k: v.to(device) for k, v in batch.items()}
        output = _generate(model, batch, config, device, times)
        answers += _decoded(codec, output, batch['input_ids'].shape[1])
    return answers


def _decoded(codec, sequences: torch.Tensor, prompt_length: int) -> list[str]:
    return [codec.decode(row) for row in sequences[:, prompt_length:].cpu()]


# --------------------------------------------------------------- shared prefill
def continues_cache(model) -> bool:
    """Whether evaluation can reuse `model`'s generation cache for the token metrics: a
    transformers generation model (peft-wrapped or not) whose positions `generate` derives
    itself. Not so for the encoder + LLM model (fsplug.model.builder imagebind_vicuna: its
    generate runs the language model on spliced embeddings and returns ids only) or a sequence
    classifier; their evaluation keeps the separate token-metric pass."""
    from transformers import GenerationMixin
    core = _generation_model(model)
    able = (isinstance(core, GenerationMixin)
            and hasattr(core, '_prepare_position_ids_for_generation')
            and 'position_ids' in inspect.signature(core.forward).parameters)
    if not able:
        logger.debug(f'fsplug.eval.shared_prefill: {type(core).__name__} cannot continue its '
                     f'generation cache; its token metrics take their own forward pass')
    return able


def _generation_model(model):
    return model.get_base_model() if hasattr(model, 'get_base_model') else model


def _cache_key(core) -> str:
    """The forward's name for the KV cache: 'cache' (transformers >= 5.x), else the older
    'past_key_values'."""
    return 'cache' if 'cache' in inspect.signature(core.forward).parameters else 'past_key_values'


def shared_prefill_answers(model, dataset, chosen: list[int], batch_size: int,
                           max_new_tokens: int, device, times: EvalTimes
                           ) -> tuple[list[str], dict[int, TokenStats]]:
    """Greedy answers to the records at `chosen` (in `generate_answers`' batches) and the token
    stats of those whose example is their prompt followed by the answer (a text codec's
    tokenisation of prompt + answer may merge across the boundary: those are left out)."""
    codec = dataset.codec
    config = _generation_config(codec, max_new_tokens, keep_cache=True)
    answers, stats = [], {}
    for start in range(0, len(chosen), batch_size):
        chunk = chosen[start:start + batch_size]
        examples = [dataset[i] for i in chunk]
        prompts = [codec.prompt_of(dataset.records[i], e) for i, e in zip(chunk, examples)]
        batch = {k: v.to(device) for k, v in codec.pad_prompts(prompts).items()}
        output = _generate(model, batch, config, device, times)
        answers += _decoded(codec, output.sequences, batch['input_ids'].shape[1])
        continued = [answer_after(p, e) for p, e in zip(prompts, examples)]
        with times.timing('prefill'):
            scored = _continued_stats(model, codec, batch, output, continued, device)
        stats.update({index: s for index, s in zip(chunk, scored) if s is not None})
    return answers, stats


def answer_after(prompt: dict, example: dict) -> dict | None:
    """{'input_ids', 'labels'} of the answer part of `example` when it is `prompt` followed
    by answer tokens (every scored label after the prompt, the media the same), else None."""
    length = len(prompt['input_ids'])
    if len(example['input_ids']) <= length or (example['labels'][:length] != IGNORE_INDEX).any():
        return None
    for key, value in prompt.items():
        same = (value, example[key][:length]) if key in TOKEN_KEYS else (value, example[key])
        if same[0].shape != same[1].shape or not torch.equal(*same):
            return None
    return {'input_ids': example['input_ids'][length:], 'labels': example['labels'][length:]}


def _continued_stats(model, codec, batch: dict, output, continued: list[dict | None],
                     device) -> list[TokenStats | None]:
    """Each row's token stats from the prompt's last logits (the first step of `output`)
    and the logits of its answer fed after the prompt, from `output`'s cache cropped back to
    the prompt; None for a row whose `continued` is None."""
    if not any(continued):
        return [None] * len(continued)
    core = _generation_model(model)
    key = _cache_key(core)
    cache = output.get(key)
    cache.crop(batch['input_ids'].shape[1] - cache.get_seq_length())
    empty = torch.empty(0, dtype=torch.long)
    answer = pad_examples([{**part, 'attention_mask': torch.ones_like(part['input_ids'])} if part
                           else {'input_ids': empty, 'labels': empty, 'attention_mask': empty}
                           for part in continued], codec.pad_token_id)
    answer = {k: v.to(device) for k, v in answer.items()}
    mask = torch.cat([batch['attention_mask'], answer['attention_mask']], dim=1)
    positions = _continued_positions(core, batch, answer['input_ids'], mask, cache, key)
    logits = model(input_ids=answer['input_ids'], attention_mask=mask, position_ids=positions,
                   use_cache=True, **{key: cache}).logits
    logits = torch.cat([output.logits[0][:, None].float(), logits.float()], dim=1).cpu()
    first = torch.full((len(continued), 1), IGNORE_INDEX, dtype=torch.long)
    labels = torch.cat([first, answer['labels'].cpu()], dim=1)
    return [codec.score(logits[row:row + 1], labels[row:row + 1]) if part else None
            for row, part in enumerate(continued)]


def _continued_positions(core, batch: dict, answer_ids, mask, cache, key: str) -> torch.Tensor:
    """The answer tokens' position ids after the cached prompt, as `generate` itself derives
    them when it continues a cache (1-D positions from the attention mask; Qwen2-VL's 3-D
    rotary positions from the prompt's rope deltas)."""
    width = answer_ids.shape[1]
    extended = {k: torch.cat([v, torch.zeros_like(v[:, :1]).expand(-1, width)], dim=1)
                for k, v in batch.items() if k in TOKEN_KEYS and k not in ('input_ids', 'attention_mask')}
    full_ids = torch.cat([batch['input_ids'], answer_ids], dim=1)
    positions = core._prepare_position_ids_for_generation(
        full_ids, {'attention_mask': mask, key: cache, **extended})
    return positions[..., -width:]


# ------------------------------------------------------------------ predictions
def write_predictions(path: str, client_id: int, records: list[dict], predictions: list[str]):
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    with open(path, 'w', encoding='utf-8') as handle:
        for record, prediction in zip(records, predictions):
            handle.write(json.dumps({
                'client': client_id, 'id': record.get('id'),
                'question': record.get('question', record.get('instruction')),
                'prediction': prediction, 'reference': reference_answer(record)}) + '\n')
