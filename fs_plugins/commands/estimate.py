"""`fs-plugins estimate`: per client, before a run, the parameters (frozen / trainable / sent
per round), an estimate of peak training memory with and without gradient checkpointing, and
the bytes up and down per round. No pretrained weight is read.

- Parameters, weights, adapters, gradients, optimiser state and bytes sent come from the whole
  model built on the meta device (shapes only) by the run's own builder, adapter and method.
  Every trainable tensor counts in float32 (4 bytes, its gradient as much, and the optimiser's
  state); under full fine-tuning (fsplug.fedavg / standalone.full_finetune) that is every
  weight, and the note says so.
- Activations are what autograd keeps for backward, counted (saved-tensor hooks) in forwards
  of the same model at reduced depth with random weights on the CPU: 1 and 2 language-model
  layers (and vision-tower layers) at the real width, 1 and 2 samples of `seq_len` tokens (plus
  the image's tokens), scaled bilinearly to the real depth and the configured batch. Peak =
  weights + adapters + gradients + optimiser state + activations + twice the float32 logits:
  when backward starts, the logits the forward returned and the gradients of the log-softmax
  and of the logits exist beside the saved log-softmax. With checkpointing, activations are
  the layer inputs plus one layer recomputed.
- Communication per client and round, from the whole model on the meta device: up = the
  method's shared tensors (`Method.shared_tensors`) + its extra payload (`Method.
  extra_payload_shapes`, the shapes of what `client_extra` sends); down = what `content_for`
  gives the client after one aggregation of such updates (after none, or up, where the method's
  server cannot run on shapes alone). Beside them FedAvg-LoRA's upload on the same builder,
  model.type and fsplug.model.lora, their ratio, and the paper's ratio where the method's
  `contract.claim` declares one.

model.type is a local folder with a config.json or a hub id whose architecture ships with
fs_plugins (fs_plugins/models/architectures/); the hub is never asked.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.base import ClientUpdate, Method, PaperClaim
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.models.builders import architecture_only
from fs_plugins.models.precision import QUANTIZED_BYTES
from fs_plugins.run.audit import fedavg_lora_up_bytes
from fs_plugins.run.config import client_config, client_overrides

GIB = 1024 ** 3
# optimiser state bytes per trainable float32 parameter, by train.optimizer.type
OPTIMIZER_STATE_BYTES = {'Adam': 8, 'AdamW': 8, 'Adamax': 8, 'NAdam': 8, 'RAdam': 8,
                         'Adagrad': 4, 'RMSprop': 4, 'Adadelta': 8}


@dataclass
class Estimate:
    client: int
    frozen_params: int
    trainable_params: int
    sent_params: int
    weights_gib: float
    adapters_gib: float   # float32 trainable tensors; their gradients take as much again
    optimizer_gib: float
    activations_gib: float | None
    activations_checkpointed_gib: float | None
    peak_gib: float | None
    peak_checkpointed_gib: float | None
    mb_up: float          # shared tensors + extra payload
    mb_down: float
    batch: int
    seq_len: int
    note: str = ''
    mb_extra: float = 0.0           # the extra payload alone (in mb_up)
    fedavg_mb_up: float | None = None   # FedAvg-LoRA on the same model and LoRA settings
    down_note: str = ''             # how mb_down was found when not after one aggregation
    claim_ratio: float | None = None    # the paper's up ratio (contract.claim), if any
    claim_source: str = ''
    other_gib: float = 0.0          # buffers + the method's memory_terms (in the peaks)
    other_note: str = ''            # those terms one by one
    sft_peak_gib: float | None = None              # SFT (standalone) on the same client config,
    sft_peak_checkpointed_gib: float | None = None  # where the paper states a memory ratio
    memory_claim: float | None = None
    memory_source: str = ''

    @property
    def memory_ratio(self) -> float | None:
        """This method's peak over SFT's (None without SFT's figure)."""
        return self.peak_gib / self.sft_peak_gib if self.peak_gib and self.sft_peak_gib else None

    @property
    def memory_ratio_checkpointed(self) -> float | None:
        return (self.peak_checkpointed_gib / self.sft_peak_checkpointed_gib
                if self.peak_checkpointed_gib and self.sft_peak_checkpointed_gib else None)

    @property
    def up_ratio(self) -> float | None:
        """This method's upload over FedAvg-LoRA's (None without a LoRA baseline)."""
        return self.mb_up / self.fedavg_mb_up if self.fedavg_mb_up else None


def optimizer_state_bytes(optimizer_cfg) -> int:
    kind = optimizer_cfg.type
    if kind == 'SGD':
        return 4 if float(optimizer_cfg.get('momentum', 0) or 0) > 0 else 0
    return OPTIMIZER_STATE_BYTES.get(kind, 8)


def frozen_weight_bytes(model: torch.nn.Module, frozen: dict, quantization: str) -> float:
    """Bytes of the frozen tensors; with a quantised base, the linear layers' weights inside the
    layer stacks at bitsandbytes' size (the output layer and embeddings stay in dtype)."""
    quantized = set()
    if quantization != 'none':
        head = model.get_output_embeddings() if hasattr(model, 'get_output_embeddings') else None
        quantized = {f'{name}.weight' for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and m is not head}
    return sum(p.numel() * (QUANTIZED_BYTES[quantization] if n in quantized else p.element_size())
               for n, p in frozen.items())


def _tensor_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def other_memory(method, model: torch.nn.Module, cfg) -> dict[str, int]:
    """The bytes beside weights, trainable tensors, optimiser state and activations: the
    model's buffers (e.g. FedMosaic's frozen global modules) and `Method.memory_terms`."""
    terms = {'buffers': sum(b.numel() * b.element_size() for b in model.buffers())}
    with architecture_only(device='meta'):   # a model the method loads for it (FedMosaic's W_s)
        terms.update(method.memory_terms(model, cfg))
    return {name: int(size) for name, size in terms.items() if size}


def other_memory_note(terms: dict[str, int]) -> str:
    return ', '.join(f'{name} {size / GIB:.3f} GiB' for name, size in terms.items())


# ---------------------------------------------------------------- communication
META_ERRORS = (NotImplementedError, RuntimeError, KeyError, TypeError, ValueError, AttributeError,
               IndexError, ZeroDivisionError)


def payload_tensors(shapes: dict) -> dict[str, torch.Tensor]:
    """Meta tensors for `Method.extra_payload_shapes`' {key: shape (float32) or (shape, dtype)}."""
    tensors = {}
    for key, value in shapes.items():
        shape, dtype = ((value[0], value[1]) if len(value) == 2 and isinstance(value[1], torch.dtype)
                        else (value, torch.float32))
        tensors[key] = torch.empty(tuple(shape), dtype=dtype, device='meta')
    return tensors


def shared_on_meta(method, model: torch.nn.Module, trainable_names) -> dict[str, torch.Tensor] | None:
    """The tensors `method` uploads from `model` built on the meta device (shapes and dtypes
    only); None when its `shared_tensors` needs real values."""
    if getattr(method.shared_tensors, '__func__', None) is Method.shared_tensors:
        trainable = set(trainable_names)   # the default: trainable tensors that is_shared picks
        return {n: p for n, p in model.named_parameters() if n in trainable and method.is_shared(n)}
    try:
        return method.shared_tensors(model, trainable_names)
    except META_ERRORS:
        return None


# below this many bytes of uploads, the server's first round runs on zero tensors (exact down)
REAL_ROUND_BYTES = 32 * 1024 ** 2
BEFORE_AGGREGATION = "down = the server's content before any aggregation"


def _content_bytes(content: dict) -> int:
    return sum(t.numel() * t.element_size() for t in content.values() if isinstance(t, torch.Tensor))


def download_bytes(method_cls, cfg, shared: dict, extra: dict, client: int) -> tuple[int, str]:
    """(bytes client `client` receives per round, '' or how they were found): `content_for`
    after one aggregation of two clients' zero uploads of these shapes when they are small
    (REAL_ROUND_BYTES); otherwise, or where the server cannot run so, `content_for` on the
    initial state (shapes only: a method whose content grows after aggregating, e.g. FLoRA's
    merged update, is under-counted), or the upload itself."""
    if _tensor_bytes(shared) + _tensor_bytes(extra) <= REAL_ROUND_BYTES:
        def zeros(tensors):
            return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in tensors.items()}
        try:
            # zero uploads are not measurements: what a server says of them (e.g. SmartFed's "no
            # usable importance") is not the run's business
            logging.disable(logging.WARNING)
            server, real = method_cls(cfg), zeros(shared)
            state = server.init_server_state(dict(real))
            updates = [ClientUpdate(cid, 1, dict(real), zeros(extra), dataset_size=1) for cid in (1, 2)]
            return _content_bytes(server.content_for(server.aggregate(state, updates), client)), ''
        except META_ERRORS:
            pass
        finally:
            logging.disable(logging.NOTSET)
    try:
        server = method_cls(cfg)
        return _content_bytes(server.content_for(server.init_server_state(dict(shared)), client)), BEFORE_AGGREGATION
    except META_ERRORS:
        return _tensor_bytes(shared), 'down = the shared tensors (server not run on shapes)'


def communication(method_cls, method, cfg, built, client: int) -> dict:
    """Estimate fields for the bytes up and down per round (see the module docstring)."""
    shared = shared_on_meta(method, built.model, built.trainable_names)
    with architecture_only(device='meta'):   # a model the method loads for it (FedMosaic's W_s)
        extra = payload_tensors(method.extra_payload_shapes(built.model, cfg))
    fields: dict = {}
    if shared is not None:
        down, how = download_bytes(method_cls, cfg, shared, extra, client)
        fields.update(sent_params=sum(t.numel() for t in shared.values()),
                      shared_bytes=_tensor_bytes(shared), mb_down=down / 1e6, down_note=how)
    fields['mb_extra'] = _tensor_bytes(extra) / 1e6
    fedavg = fedavg_lora_up_bytes(cfg)
    fields['fedavg_mb_up'] = None if fedavg is None else fedavg / 1e6
    claim: PaperClaim | None = method_cls.contract.claim
    if claim is not None:
        fields.update(claim_ratio=claim.up_ratio, claim_source=claim.source)
    return fields


# ---------------------------------------------------------------- activations
def saved_activation_bytes(model: torch.nn.Module, batch: dict) -> tuple[int, int]:
    """(total, largest) bytes of the distinct tensors autograd keeps for backward during one
    training forward of `model` on `batch` (parameters and buffers left out)."""
    weights = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    saved: dict[int, int] = {}
    kept = []   # alive until the forward ends, as in training (a freed address is not reused)

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
            kept.append(tensor)
        # not the tensor: an op that saves its own output would hold it from its graph node
        # (a cycle through C++ the garbage collector cannot see: every probe's model leaked)
        return None

    def unpack(_):
        raise RuntimeError('the activation probe runs no backward pass')

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        output = model(**batch)
    sizes = list(saved.values()) + [output.loss.numel() * output.loss.element_size()]
    kept.clear()
    return sum(sizes), max(sizes)


def probe_batch(model: torch.nn.Module, seq_len: int, generator: torch.Generator) -> dict:
    """One random training sample for `model`: `seq_len` text tokens, all labelled, after the
    image's tokens for a LLaVA-style model (config.image_token_id / vision_config)."""
    config = model.config if hasattr(model, 'config') else None
    vocab = getattr(getattr(config, 'text_config', config), 'vocab_size', None)
    if vocab is None:
        raise ConfigError(f'estimate: cannot make a probe batch for {type(model).__name__} '
                          f'(no config.vocab_size)')
    text = torch.randint(0, min(int(vocab), 1000), (1, seq_len), generator=generator)
    batch = {'input_ids': text, 'labels': text.clone()}
    vision = getattr(config, 'vision_config', None)
    image_token = getattr(config, 'image_token_id', getattr(config, 'image_token_index', None))
    if vision is not None:
        if image_token is None or not hasattr(vision, 'image_size'):
            raise ConfigError(f'estimate: activation probe supports LLaVA-style vision models '
                              f'only, not {type(model).__name__}')
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        if getattr(config, 'vision_feature_select_strategy', 'default') == 'full':
            patches += 1
        image = torch.full((1, patches), int(image_token))
        batch['input_ids'] = torch.cat([image, text], dim=1)
        batch['labels'] = torch.cat([torch.full_like(image, -100), text], dim=1)
        dtype = next(model.parameters()).dtype
        batch['pixel_values'] = torch.randn(1, 3, int(vision.image_size), int(vision.image_size),
                                            generator=generator).to(dtype)
    batch['attention_mask'] = torch.ones_like(batch['input_ids'])
    return batch


def _depths(config) -> dict[str, int]:
    """Layer counts of the real model: the language model's and, if any, the vision tower's."""
    text = getattr(config, 'text_config', config)
    depths = {'text': int(getattr(text, 'num_hidden_layers', 0) or 0)}
    vision = getattr(config, 'vision_config', None)
    if vision is not None and getattr(vision, 'num_hidden_layers', None):
        depths['vision'] = int(vision.num_hidden_layers)
    return depths


def _probe(cfg, method_cls, layers: dict, samples: int, seq_len: int,
           checkpointing: bool) -> torch.Tensor:
    """(activation bytes, logits bytes, sent bytes, sent parameters) of `samples` samples
    through the model at depth `layers`."""
    probe_cfg = copy.deepcopy(cfg)
    probe_cfg.fsplug.train.gradient_checkpointing = checkpointing
    probe_cfg.fsplug.model.quantization = 'none'   # activations do not depend on it
    # options bounded by the depth (FedMosaic's N_B) at 1 in every probe: they fit one layer,
    # and the increment of the second layer is an ordinary one, as most layers are
    options = getattr(probe_cfg.fsplug, method_cls.name, None)
    for key in method_cls.contract.depth_options:
        if options is not None and key in options:
            options[key] = min(int(options[key]), 1)
    with architecture_only(device='cpu', layers=layers):
        method = method_cls(probe_cfg)
        built = build_model(probe_cfg, method, share_frozen=False)
    generator = torch.Generator().manual_seed(0)
    batch = probe_batch(built.model, seq_len, generator)
    batch = {k: torch.cat([v] * samples) for k, v in batch.items()}
    saved = saved_activation_bytes(built.model, batch)[0]
    config = getattr(built.model.config, 'text_config', None) or built.model.config
    logits = batch['input_ids'].numel() * int(getattr(config, 'vocab_size', 0) or 0) * 4
    sent = method.shared_tensors(built.model, built.trainable_names)
    return torch.tensor([saved, logits, _tensor_bytes(sent), sum(t.numel() for t in sent.values())],
                        dtype=torch.float64)


def memoised_probe(cfg, method_cls, seq_len: int):
    """_probe for this config as probe(layers, samples, checkpointing), each distinct probe
    built and run once (the plain and the checkpointed estimate share some)."""
    done: dict[tuple, torch.Tensor] = {}

    def probe(layers: dict, samples: int, checkpointing: bool) -> torch.Tensor:
        key = (tuple(sorted(layers.items())), samples, checkpointing)
        if key not in done:
            done[key] = _probe(cfg, method_cls, layers, samples, seq_len, checkpointing)
        return done[key]
    return probe


def _layer_at_batch(probe, one: dict, stack: str, batch: int, checkpointing: bool):
    """One more `stack` layer's figures at the batch, bilinear from probes at 1 and 2 samples."""
    deeper = {**one, stack: 2}
    per_layer = probe(deeper, 1, checkpointing) - probe(one, 1, checkpointing)
    cross = probe(deeper, 2, checkpointing) - probe(one, 2, checkpointing) - per_layer
    return per_layer + cross * (batch - 1)


def scaled_probe(probe, depths: dict, batch: int, checkpointing: bool) -> torch.Tensor:
    """probe's figures (see memoised_probe) at the real depths and batch, bilinear in each
    stack's depth L and the batch b (some saved tensors grow with L·b, e.g. a layer's
    activations, some with L only, e.g. the merged expert weights of peft's target_parameters):
    measured at (L, b) = (1, 1), (2, 1), (1, 2), (2, 2) per stack. With checkpointing, one
    language-model layer's plain activations are added: they exist again while that layer is
    recomputed in backward."""
    one = {stack: 1 for stack in depths}
    base = probe(one, 1, checkpointing)
    total = base + (probe(one, 2, checkpointing) - base) * (batch - 1)
    for stack, depth in depths.items():
        total += _layer_at_batch(probe, one, stack, batch, checkpointing) * (depth - 1)
    if checkpointing:
        total[0] += _layer_at_batch(probe, one, 'text', batch, False)[0]
    return total


# ---------------------------------------------------------------- per client
def estimate_client(cfg, client: int, seq_len: int | None = None, activations: bool = True,
                    beside_sft: bool = True) -> Estimate:
    """One client's estimate; `activations` False skips the activation probe (the forwards at
    1-2 layers: seconds instead of minutes at 7B widths) and leaves those columns empty.
    Where the method's paper states a memory ratio to SFT (`PaperClaim.memory_ratio`) and
    `beside_sft`, SFT's peaks on the same client config are estimated too."""
    method_cls = get_method_class(cfg.fsplug.method)
    method = method_cls(cfg)
    if cfg.fsplug.model.quantization != 'none' and method.modifies_frozen_weights:
        raise ConfigError(f"fsplug.model.quantization = '{cfg.fsplug.model.quantization}': "
                          f"method '{method.name}' edits the frozen base weights")
    sized = copy.deepcopy(cfg)   # sized here without CUDA or bitsandbytes
    sized.fsplug.model.quantization = 'none'
    with architecture_only(device='meta'):
        built = build_model(sized, method, share_frozen=False)
    model = built.model
    params = dict(model.named_parameters())
    trainable = {n: params[n] for n in built.trainable_names}
    frozen = {n: p for n, p in params.items() if n not in trainable}
    trainable_count = sum(p.numel() for p in trainable.values())
    weights = frozen_weight_bytes(model, frozen, cfg.fsplug.model.quantization)
    adapters = 4 * trainable_count
    optimizer = optimizer_state_bytes(cfg.train.optimizer) * trainable_count
    other = other_memory(method, model, sized)
    static = weights + 2 * adapters + optimizer + sum(other.values())
    batch, seq = int(cfg.dataloader.batch_size), int(seq_len or cfg.llm.tok_len)
    comm = communication(method_cls, method, cfg, built, client)
    acts, sent, note = (None,) * 4, (4.0 * trainable_count, trainable_count), ''
    if 'shared_bytes' in comm:
        sent = (float(comm.pop('shared_bytes')), int(comm.pop('sent_params')))
    if activations:
        try:
            depths = _depths(model.config)
            probe = memoised_probe(cfg, method_cls, seq)
            plain = scaled_probe(probe, depths, batch, False)
            checkpointed = scaled_probe(probe, depths, batch, True)
            transient = 2 * plain[1]
            acts = (plain[0] / GIB, checkpointed[0] / GIB, (static + plain[0] + transient) / GIB,
                    (static + checkpointed[0] + transient) / GIB)
            if 'down_note' not in comm:   # shared tensors need values: the probe's, scaled
                sent = (float(plain[2]), int(plain[3]))
        except (ConfigError, AttributeError, NotImplementedError, RuntimeError, ValueError) as exc:
            note = f'no activation probe: {str(exc)[:200]}'
    else:
        note = 'activations not probed'
    if 'down_note' not in comm:
        note = '; '.join(filter(None, [note, 'sent = trainable' if not activations or acts[0] is None
                                      else 'sent scaled from the probe']))
        comm.update(mb_down=sent[0] / 1e6, down_note='down = up')
    if trainable and not frozen:
        note = '; '.join(filter(None, [note, full_finetune_note(adapters, optimizer)]))
    mb_up = (sent[0] + comm['mb_extra'] * 1e6) / 1e6
    comm.update(other_gib=sum(other.values()) / GIB, other_note=other_memory_note(other),
                **sft_peaks(method_cls, cfg, client, seq_len, activations and beside_sft))
    return Estimate(client, sum(p.numel() for p in frozen.values()), trainable_count, sent[1],
                    weights / GIB, adapters / GIB, optimizer / GIB,
                    *[None if a is None else float(a) for a in acts],
                    mb_up=mb_up, batch=batch, seq_len=seq, note=note, **comm)


SFT_METHOD = 'standalone'   # Table 15's SFT: one LoRA, one forward and backward per step


def sft_peaks(method_cls, cfg, client: int, seq_len, wanted: bool) -> dict:
    """Estimate fields of SFT's peaks on this client config, where the paper states a memory
    ratio (empty otherwise)."""
    claim: PaperClaim | None = method_cls.contract.claim
    if not wanted or claim is None or claim.memory_ratio is None or method_cls.name == SFT_METHOD:
        return {}
    sft_cfg = copy.deepcopy(cfg)
    sft_cfg.fsplug.method = SFT_METHOD
    sft = estimate_client(sft_cfg, client, seq_len, activations=True, beside_sft=False)
    return {'sft_peak_gib': sft.peak_gib, 'sft_peak_checkpointed_gib': sft.peak_checkpointed_gib,
            'memory_claim': claim.memory_ratio, 'memory_source': claim.memory_source}


def full_finetune_note(weight_bytes: float, optimizer_bytes: float) -> str:
    """The line for a model whose every weight trains (fsplug.<method>.full_finetune): where
    its static memory goes, in float32."""
    return (f'full fine-tuning: every weight trains in float32: weights {weight_bytes / GIB:.2f} '
            f'+ gradients {weight_bytes / GIB:.2f} + optimiser state {optimizer_bytes / GIB:.2f} '
            f'GiB (in adapters + grads + optimiser)')


def estimate_run(cfg, client_cfgs=None, seq_len: int | None = None,
                 activations: bool = True) -> list[Estimate]:
    """One estimate per client (clients with the same effective config are probed once)."""
    overrides = client_overrides(client_cfgs, cfg)
    clients = range(1, max(int(cfg.federate.client_num), 1) + 1)
    done: dict[str, Estimate] = {}
    estimates = []
    for cid in clients:
        ccfg = client_config(cfg, overrides.get(cid))
        key = repr(overrides.get(cid))
        if key not in done:
            done[key] = estimate_client(ccfg, cid, seq_len, activations)
        estimates.append(Estimate(**{**asdict(done[key]), 'client': cid}))
    return estimates


def _client_ranges(clients: list[int]) -> str:
    """'1-4, 7' for [1, 2, 3, 4, 7]."""
    runs: list[list[int]] = []
    for cid in clients:
        if runs and cid == runs[-1][-1] + 1:
            runs[-1].append(cid)
        else:
            runs.append([cid])
    return ', '.join(str(r[0]) if len(r) == 1 else f'{r[0]}-{r[-1]}' for r in runs)


def communication_table(estimates: list[Estimate]) -> str:
    """Bytes per client and round beside FedAvg-LoRA's and the paper's ratio; clients with the
    same figures share a row."""
    def ratio(value):
        return '–' if value is None else f'{value:.3f}'
    groups: dict[tuple, list[int]] = {}
    for e in estimates:
        key = (e.mb_up, e.mb_extra, e.mb_down, e.fedavg_mb_up, e.up_ratio, e.claim_ratio, e.down_note)
        groups.setdefault(key, []).append(e.client)
    rows = ['| clients | MB up (of it extra) | MB down | FedAvg-LoRA MB up | up ratio vs FedAvg-LoRA '
            '| paper\'s up ratio |', '|' + '---|' * 6]
    for (up, extra, down, fedavg, measured, claimed, _), clients in groups.items():
        fedavg_cell = '–' if fedavg is None else f'{fedavg:.1f}'
        claim_cell = ('–' if not estimates[0].claim_source else
                      'no ratio' if claimed is None else ratio(claimed))
        rows.append(f'| {_client_ranges(clients)} | {up:.1f} ({extra:.3f}) | {down:.1f} | {fedavg_cell} | '
                    f'{ratio(measured)} | {claim_cell} |')
    notes = sorted({e.down_note for e in estimates if e.down_note})
    lines = rows + ['per round; up = shared tensors + extra payload (Method.extra_payload_shapes), '
                    'down = what the server sends the client' + (f' ({"; ".join(notes)})' if notes else '')]
    if estimates[0].claim_source:
        lines.append(f'paper: {estimates[0].claim_source}')
    return '\n'.join(lines)


def format_table(estimates: list[Estimate]) -> str:
    def gib(value):
        return '–' if value is None else f'{value:.2f}'
    header = ('| client | frozen params | trainable | sent / round | weights GiB | adapters + grads '
              '+ optimiser GiB | buffers + method state GiB | activations GiB (checkpointed) | '
              'peak GiB (checkpointed) | MB up / down |')
    rows = [header, '|' + '---|' * 10]
    for e in estimates:
        rows.append(f'| {e.client} | {e.frozen_params:,} | {e.trainable_params:,} | '
                    f'{e.sent_params:,} | {e.weights_gib:.2f} | '
                    f'{2 * e.adapters_gib + e.optimizer_gib:.3f} | {e.other_gib:.3f} | '
                    f'{gib(e.activations_gib)} ({gib(e.activations_checkpointed_gib)}) | '
                    f'{gib(e.peak_gib)} ({gib(e.peak_checkpointed_gib)}) | '
                    f'{e.mb_up:.1f} / {e.mb_down:.1f} |')
    notes = [f'client {e.client}: {e.note}' for e in estimates if e.note]
    notes += [f'client {e.client}: {e.other_note}' for e in estimates if e.other_note]
    first = estimates[0]
    memory = memory_table(estimates)
    return '\n'.join(rows + [f'batch {first.batch} × {first.seq_len} text tokens per sample '
                             f'(plus image tokens)'] + notes
                     + (['', 'Memory beside SFT (the paper\'s ratio):', memory] if memory else [])
                     + ['', 'Communication per client and round:', communication_table(estimates)])


def memory_table(estimates: list[Estimate]) -> str:
    """Peak memory over SFT's beside the paper's ratio, clients with the same figures in one
    row ('' when no estimate has SFT's figure)."""
    def gib(value):
        return '–' if value is None else f'{value:.2f}'

    def ratio(value):
        return '–' if value is None else f'{value:.3f}'
    groups: dict[tuple, list[int]] = {}
    for e in estimates:
        if e.sft_peak_gib is None:
            continue
        key = (e.peak_gib, e.peak_checkpointed_gib, e.sft_peak_gib, e.sft_peak_checkpointed_gib,
               e.memory_ratio, e.memory_ratio_checkpointed, e.memory_claim)
        groups.setdefault(key, []).append(e.client)
    if not groups:
        return ''
    rows = ['| clients | peak GiB (checkpointed) | SFT peak GiB (checkpointed) | ratio (checkpointed) '
            '| paper |', '|' + '---|' * 5]
    for (peak, peak_ckpt, sft, sft_ckpt, measured, measured_ckpt, claim), clients in groups.items():
        rows.append(f'| {_client_ranges(clients)} | {gib(peak)} ({gib(peak_ckpt)}) | {gib(sft)} '
                    f'({gib(sft_ckpt)}) | {ratio(measured)} ({ratio(measured_ckpt)}) | {ratio(claim)} |')
    source = next(e.memory_source for e in estimates if e.sft_peak_gib is not None)
    return '\n'.join(rows + [f'SFT = fsplug.method {SFT_METHOD} on the same client config; paper: {source}'])
