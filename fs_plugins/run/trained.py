"""Using a run's fine-tuned model (issue 18): answer questions, re-evaluate on another dataset,
export a Hugging Face model. The commands `fs-plugins predict | eval | export` call these.

Every function starts from `fs_plugins.load_trained(run_dir, client)`, so it sees exactly the
model the run evaluated (the global state for client None)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import torch

from fs_plugins.data.instruction import load_records, read_record_file
from fs_plugins.data.multimodal import is_multimodal, with_absolute_images
from fs_plugins.methods.registry import get_method_class
from fs_plugins.methods.specs import device_for
from fs_plugins.models.codecs import EncodedDataset, MultimodalCodec
from fs_plugins.models.olmoe import fuse_expert_gate_up
from fs_plugins.run.artifacts import ArtifactError, load_trained_with_config
from fs_plugins.run.evaluation import generate_answers, generation_metrics, token_metrics

logger = logging.getLogger(__name__)

EXPORT_JSON = 'fsplug_export.json'


# ---------------------------------------------------------------------- inputs
def read_prompts(path: str, multimodal: bool) -> list[dict]:
    """Questions to answer, from a .jsonl or .json file: `instruction` (+ `input`) records for a
    text model, `image` + `question` records for a vision-language one (image paths relative
    to the file); answers are not needed. A record that does not fit is named."""
    _must_exist(path, 'Input file')
    records = read_record_file(path)
    if not records:
        raise ValueError(f'Input file {path} holds no records')
    folder = os.path.dirname(os.path.abspath(path))
    out = []
    for index, record in enumerate(records):
        where = f'record {index} (line {index + 1}) of {path}'
        if not isinstance(record, dict):
            raise ValueError(f'{where} is not an object')
        if multimodal:
            if not is_multimodal(record):
                raise ValueError(f"{where}: the run's model answers media records "
                                 f"('question' and 'image' or 'audio'); this record has "
                                 f"{sorted(record)}")
            record = with_absolute_images(record, folder, where)
        elif 'instruction' not in record:
            raise ValueError(f"{where}: the run's model answers text records ('instruction', "
                             f"optionally 'input'); this record has {sorted(record)}")
        out.append({**record, 'id': str(record.get('id', index))})
    return out


def _must_exist(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f'{what} not found: {path}')


def _batch_size(cfg, requested: int | None) -> int:
    return int(requested or cfg.fsplug.eval.batch_size or cfg.dataloader.batch_size)


def _device(requested: str | None, cfg) -> str:
    return requested or device_for(cfg)


def _load(run_dir: str, client: int | None, device: str | None, import_modules=()):
    """(built model, its config, device) of a run's client (or global state), on the device."""
    built, cfg = load_trained_with_config(run_dir, client, import_modules)
    device = _device(device, cfg)
    built.model.to(device)
    return built, cfg, device


# ---------------------------------------------------------------------- predict
@torch.no_grad()
def predict(run_dir: str, input_path: str, client: int | None = None, batch_size: int | None = None,
            max_new_tokens: int | None = None, device: str | None = None,
            import_modules=()) -> list[dict]:
    """Greedy answers of the run's model to every record of `input_path`, in batches."""
    _must_exist(input_path, 'Input file')
    built, cfg, device = _load(run_dir, client, device, import_modules)
    records = read_prompts(input_path, isinstance(built.codec, MultimodalCodec))
    answers = generate_answers(built.model, built.codec, records, _batch_size(cfg, batch_size),
                               int(max_new_tokens or cfg.fsplug.eval.max_new_tokens), device)
    return [{'id': r['id'], 'question': r.get('question', r.get('instruction')),
             **({'input': r['input']} if r.get('input') else {}), 'prediction': a}
            for r, a in zip(records, answers)]


# ------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(run_dir: str, data_path: str, client: int | None = None, batch_size: int | None = None,
             device: str | None = None, import_modules=()) -> dict:
    """The run's configured metrics on another dataset (records with answers, the format of
    the training data): answer-token loss and accuracy, plus fsplug.eval.gen_metrics when the
    run generated (fsplug.eval.generate)."""
    _must_exist(data_path, 'Data file')
    built, cfg, device = _load(run_dir, client, device, import_modules)
    dataset = EncodedDataset(load_records(data_path), built.codec, data_path)
    if not len(dataset):
        raise ValueError(f'{data_path}: no record fits the model (llm.tok_len = {cfg.llm.tok_len})')
    size = _batch_size(cfg, batch_size)
    metrics = token_metrics(built.model, dataset, built.codec.collate, size, 'eval', device)
    if cfg.fsplug.eval.generate:
        metrics.update(generation_metrics(built.model, built.codec, dataset.records,
                                          cfg.fsplug.eval, size, 'eval', device))
    return metrics


# ----------------------------------------------------------------------- export
def own_modules(model: torch.nn.Module, merging: bool = True) -> list[str]:
    """Modules of this package's own classes (Fed-MoLE experts, FLAME rescalers, ...): a plain
    Hugging Face model cannot hold them. Classes marked `fsplug_merge_restores` go back to
    transformers' layout once merged (the split OLMoE experts), so only count when not merging."""
    return [name for name, module in model.named_modules()
            if type(module).__module__.startswith('fs_plugins.')
            and not (merging and getattr(type(module), 'fsplug_merge_restores', False))]


def _plain_lora_or_refuse(model, method: str, what: str, merging: bool) -> None:
    reason = get_method_class(method).hf_export_refusal
    if reason:
        raise ArtifactError(f"Cannot export {what} of method '{method}' as a Hugging Face model: "
                            f"{reason}; use fs_plugins.load_trained or `fs-plugins predict` instead")
    custom = own_modules(model, merging)
    if custom:
        raise ArtifactError(f"Cannot export {what} of method '{method}' as a Hugging Face model: "
                            f"it has modules of its own ({', '.join(custom[:3])}"
                            f"{', ...' if len(custom) > 3 else ''}); use fs_plugins.load_trained "
                            f"or `fs-plugins predict` instead")


def _save_preprocessing(codec, out_dir: str) -> None:
    (codec.processor if isinstance(codec, MultimodalCodec) else codec.tokenizer).save_pretrained(out_dir)


def export(run_dir: str, out_dir: str, client: int | None = None, merge: bool = False,
           import_modules=()) -> str:
    """Writes the run's model (a client's, or the global state) as a self-contained Hugging
    Face folder: with merge, the LoRA merged into the base weights (peft merge_and_unload) —
    a full model any HF tooling loads; without, the peft adapter folder plus the tokenizer.
    Plain-LoRA methods only: models with the method's own modules are refused. It is written
    into a fresh temporary folder beside `out_dir`, renamed into place when complete."""
    built, cfg, _ = _load(run_dir, client, 'cpu', import_modules)
    what = 'the global model' if client is None else f'client {client}'
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f'Export folder {out_dir} exists and is not empty')
    _plain_lora_or_refuse(built.model, cfg.fsplug.method, what, merge)
    model = _exportable(built.model, cfg.fsplug.method, what, merge)
    parent, name = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{name}.tmp-', dir=parent)
    try:
        _write_export(model, built.codec, tmp, {
            'run': os.path.abspath(run_dir), 'client': client, 'merged': merge,
            'method': cfg.fsplug.method, 'base': str(cfg.model.type)})
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(f'fs-plugins: exported {what} of {run_dir} -> {out_dir}')
    return out_dir


def _exportable(model, method: str, what: str, merge: bool):
    """The model as peft saves it: merged into its base weights, or its single adapter."""
    if merge:
        # the base tensors may be shared with other models of this process (builders'
        # frozen-tensor cache); merging writes into them, so merge into copies
        for param in model.parameters():
            param.data = param.data.clone()
        model = model.merge_and_unload()
        fuse_expert_gate_up(model)
    elif len(model.peft_config) > 1:
        raise ArtifactError(f"Cannot export {what} of method '{method}' as one peft "
                            f"adapter: its forward combines the adapters {list(model.peft_config)}; "
                            f"export with --merge")
    return model


def _write_export(model, codec, folder: str, description: dict) -> None:
    model.save_pretrained(folder)
    _save_preprocessing(codec, folder)
    with open(os.path.join(folder, EXPORT_JSON), 'w', encoding='utf-8') as handle:
        json.dump(description, handle, indent=2)
    # mkdtemp makes the folder owner-only; an export is as shareable as any folder made here
    os.chmod(folder, 0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
