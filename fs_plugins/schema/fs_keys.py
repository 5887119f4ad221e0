"""The FederatedScope keys the plugin reads, with FS's defaults and the ranges the plugin needs.

The embedded runner accepts exactly these FS keys (any other is an error: it would be ignored
there); under FederatedScope, FS knows its own keys and these are checked for type and range.
FS-LLM's keys among them (llm.adapter.*, train.is_enable_half, data.splits, ...) are mapped
onto the plugin's by `fs_plugins.schema.fs_llm`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fs_plugins.core.registry import GENERATION_METRICS, REPORTED_METRICS, SPLITTERS
from fs_plugins.schema.options import option, section


def reported_metric_names() -> list[str]:
    """The metrics a client's evaluation reports besides the loss (eval.metrics may name them)."""
    return REPORTED_METRICS.names() + GENERATION_METRICS.names()


def evaluation_metric_names() -> list[str]:
    """Every test_<metric> and val_<metric> a client's evaluation can report (the choices of
    FS's eval.best_res_update_round_wise_key for fsplug runs; val_* needs a validation split)."""
    return [f'{split}_{name}' for split in ('test', 'val')
            for name in ['avg_loss'] + reported_metric_names()]


@dataclass
class FederateKeys:
    mode: str = option('standalone', 'standalone, or distributed (FS only)',
                       choices=('standalone', 'distributed'))
    method: str = option('FedAvg', "must be 'fsplug' when fsplug.method is set (FS's 'FedAvg' is "
                                   'mapped to it)')
    client_num: int = option(0, 'number of clients (by_source: the number of sources)', ge=1)
    sample_client_num: int = option(-1, 'clients per round (-1: from sample_client_rate, else all)',
                                    ge=1, special=(-1,))
    sample_client_rate: float = option(-1.0, 'fraction of clients per round (-1: unset)',
                                       gt=0, le=1, special=(-1, -1.0))
    total_round_num: int = option(50, 'communication rounds', ge=1)
    share_local_model: bool = option(False, 'either way every fsplug client builds its own model '
                                            '(the frozen base is shared within a process); under FS, '
                                            'True keeps each model on its device between routines')


@dataclass
class DataKeys:
    root: str = option('data', 'folder of data files and of the builtin datasets it writes')
    type: str = option('', "'<file.json|file.jsonl|builtin name>@fsplug' or FS-LLM's '<name>@llm'")
    splitter: str = option('', "how records become clients (FS-LLM's 'meta' is mapped to "
                               "'by_source' on the category field)", choices=SPLITTERS.names)
    splits: list[float] = option([0.8, 0.1, 0.1], "FS-LLM's [train, val, test] fractions: set "
                                                  '(not left at this default), val and test become '
                                                  "fsplug.data.val_fraction / test_fraction of each "
                                                  "client's records")
    splitter_args: list[dict] = option([], "FS's [{alpha: a}]: a becomes fsplug.data.dirichlet_alpha")


@dataclass
class ModelKeys:
    type: str = option('', "'<local dir or hub id>@fsplug_llm' (FS-LLM's '@huggingface_llm' is mapped "
                           'to it)')


@dataclass
class TrainerKeys:
    type: str = option('general', "must be 'fsplug' when fsplug.method is set (FS-LLM's 'llmtrainer' "
                                  'is mapped to it)')


@dataclass
class DataloaderKeys:
    batch_size: int = option(64, 'training batch size', ge=1)


@dataclass
class OptimizerKeys:
    open_keys: ClassVar[bool] = True   # any other key is a keyword argument of the optimiser
    type: str = option('SGD', 'a torch.optim optimiser class name')
    lr: float = option(0.1, 'learning rate', gt=0)


@dataclass
class SchedulerKeys:
    open_keys: ClassVar[bool] = True   # any other key is a keyword argument of the scheduler
    type: str = option('', "a torch.optim.lr_scheduler class name ('' = none)")
    warmup_ratio: float = option(0.0, "must stay 0: read only by FS's hetero-NLP trainer (FS's "
                                      'get_scheduler drops it); pick a torch scheduler with warmup',
                                 ge=0, le=1)


@dataclass
class TrainKeys:
    local_update_steps: int = option(1, 'local steps (or epochs) per round', ge=1)
    batch_or_epoch: str = option('batch', 'unit of local_update_steps', choices=('batch', 'epoch'))
    optimizer: OptimizerKeys = section(OptimizerKeys, 'local optimiser')
    scheduler: SchedulerKeys = section(SchedulerKeys, 'local learning-rate schedule')
    is_enable_half: bool = option(False, "FS-LLM's half precision: True means fsplug.model.dtype: "
                                         'float16 (the frozen base; trainables stay float32)')


@dataclass
class GradKeys:
    grad_clip: float = option(-1.0, 'gradient norm clip (-1: off)', gt=0, special=(-1, -1.0))
    grad_accum_count: int = option(1, 'micro-batches (of dataloader.batch_size) per optimiser step: '
                                      'a local step accumulates this many (FS semantics); gradients '
                                      'equal those of one batch this many times larger', ge=1)


@dataclass
class EvalKeys:
    freq: int = option(1, 'evaluate every freq rounds (and after the last)', ge=1)
    count_flops: bool = option(False, "FS counts the FLOPs of the plugin's forward (FS runs only)")
    metrics: list[str] = option([], "FS's monitor's metrics: 'loss' (reported as avg_loss), the "
                                    'reported and generation metrics of fsplug clients')
    best_res_update_round_wise_key: str = option('test_avg_loss', "FS's best-result metric (FS-LLM's "
                                                                  "'<split>_loss' means "
                                                                  "'<split>_avg_loss'); val_* needs "
                                                                  'a validation split',
                                                 choices=evaluation_metric_names)


@dataclass
class LlmAdapterKeys:
    use: bool = option(False, "FS-LLM's adapter switch: fsplug methods always train adapters, so "
                              'llm.adapter.args needs True')
    args: list[dict] = option([{}], "FS-LLM's peft arguments [{adapter_method: lora|vera, r, "
                                    'lora_alpha, lora_dropout, target_modules, ...}]: they become '
                                    'fsplug.model.lora.* / fsplug.model.vera.* (a different '
                                    'explicit fsplug value is an error)')


@dataclass
class LlmKeys:
    tok_len: int = option(128, 'maximum tokens per example', ge=1)
    adapter: LlmAdapterKeys = section(LlmAdapterKeys, "FS-LLM's adapter (mapped onto fsplug.model)")


@dataclass
class DistributeKeys:
    """FS's distributed mode (gRPC); `fs-plugins launch` writes them for each party."""
    use: bool = option(False, 'FS distributed mode: on')
    role: str = option('client', 'this party', choices=('server', 'client'))
    data_idx: int = option(-1, "client k's data (1 .. client_num); also its id with fsplug "
                               'methods', ge=-1)
    server_host: str = option('0.0.0.0', 'the address the server listens on / clients reach it at')
    server_port: int = option(50050, "the server's port", ge=1, le=65535)
    client_host: str = option('0.0.0.0', "this client's address, which the server reaches")
    client_port: int = option(50050, "this client's port", ge=1, le=65535)
    data_file: str = option('data', "FS's centralised data file (unused by fsplug data)")
    grpc_max_send_message_length: int = option(300 * 1024 * 1024, 'bytes (raised to '
                                                                   'fsplug.distribute.'
                                                                   'max_message_mb)', ge=1)
    grpc_max_receive_message_length: int = option(300 * 1024 * 1024, 'bytes (raised to '
                                                                      'fsplug.distribute.'
                                                                      'max_message_mb)', ge=1)
    grpc_enable_http_proxy: bool = option(False, 'let gRPC use an HTTP proxy')
    grpc_compression: str = option('nocompression', 'gRPC message compression',
                                   choices=('nocompression', 'deflate', 'gzip'))


@dataclass
class NbaflKeys:
    """FS's NbAFL (Wei et al., 2020, "Federated Learning with Differential Privacy: Algorithms
    and Performance Analysis"): clipped, Gaussian-noised uploads and broadcasts of the shared
    tensors (fs_plugins.run.privacy). The plugin follows the paper; FS's own sigma_U has no
    factor 2 and FS clips no upload."""
    use: bool = option(False, 'NbAFL differential privacy on what is uploaded and broadcast')
    mu: float = option(0.0, 'proximal term of NbAFL (FS applies it to the whole model): must '
                            'be 0 with fsplug methods; use fsplug.method: fedprox', ge=0)
    epsilon: float = option(100.0, 'privacy budget epsilon', gt=0)
    w_clip: float = option(1.0, 'C: each upload (all shared tensors together) is scaled to '
                                'norm <= C', gt=0)
    constant: float = option(30.0, 'c of sigma_U = c*T*2C/(m*epsilon) (c >= sqrt(2 ln(1.25/delta)))',
                             gt=0)


@dataclass
class FSKeys:
    seed: int = option(0, 'run seed: the same YAML and seed give the same numbers')
    expname: str = option('', 'experiment name (results folder)')
    outdir: str = option('exp', 'output folder')
    use_gpu: bool = option(False, 'train on cuda:<device> when available')
    device: int = option(-1, 'GPU index (-1: the first)', ge=-1)
    backend: str = option('torch', 'FS backend', choices=('torch',))
    federate: FederateKeys = section(FederateKeys, 'the federation')
    data: DataKeys = section(DataKeys, 'the data file and its split')
    model: ModelKeys = section(ModelKeys, 'the model location')
    trainer: TrainerKeys = section(TrainerKeys, 'the trainer')
    dataloader: DataloaderKeys = section(DataloaderKeys, 'batching')
    train: TrainKeys = section(TrainKeys, 'local training')
    grad: GradKeys = section(GradKeys, 'gradient processing')
    eval: EvalKeys = section(EvalKeys, 'evaluation schedule')
    llm: LlmKeys = section(LlmKeys, 'FS-LLM settings')
    distribute: DistributeKeys = section(DistributeKeys, "FS's distributed mode (FS only)")
    nbafl: NbaflKeys = section(NbaflKeys, 'NbAFL differential privacy')
