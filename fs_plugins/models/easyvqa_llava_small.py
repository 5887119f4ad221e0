"""The `easyvqa_llava_small` builder: a smaller sibling of `easyvqa_llava` for heterogeneous
federations (FedMosaic's LLaVA-Llama3.2-1B beside -3B, offline): a different Llama-family
language model (narrower AND shallower) behind the same trained vision tower (copied from the
`easyvqa_llava` folder), image processor, tokenizer and chat template, with a fresh seeded
projector into the new hidden size.

The language model is derived from `easyvqa_llava`'s (SmolLM2-135M-Instruct plus its <image>
row) without training, in the spirit of SliceGPT (Ashkboos et al., ICLR 2024, "SliceGPT:
Compress Large Language Models by Deleting Rows and Columns") plus layer dropping:

1. Depth: keep `KEPT_LAYERS`, 20 of the 30 decoder layers, chosen by greedy layer dropping:
   drop, one at a time, the layer whose removal raises the mean token loss least on easy-vqa
   train texts outside the calibration sample plus the generic calibration chats; the first two
   and last two layers always stay (`python -m fs_plugins.models.easyvqa_llava_small
   --choose-layers` repeats it in about half an hour).
2. Width: the residual stream goes from 576 to `SMALL_HIDDEN_SIZE` = 432 dimensions (448 is not
   possible: LlamaConfig needs hidden_size to be a multiple of the 9 attention heads; heads,
   key/value heads, head_dim 64 and intermediate_size are unchanged). Each RMSNorm weight is
   folded into the input columns of the linear layers that read its output, so the norms only
   divide by the RMS. Q (576 × 432) holds the top principal directions of the residual stream
   at every norm's input (each token's vector scaled to unit length first, so that every
   location counts equally, as the norm sees only directions) on calibration text: 128 easy-vqa
   train question/answer texts in the LLaVA prompt format and ten generic chat exchanges. Then
   every weight that reads the stream (embeddings, q/k/v, gate/up, lm_head) becomes W Q and
   every weight that writes it (o_proj, down_proj) becomes Qᵀ W.

   SliceGPT gives every block its own Q and puts Q_lᵀ Q_{l+1} on the shortcut; a plain
   LlamaForCausalLM has no matrix there, so one global Q is used. The RMS of the sliced vector
   z = Qᵀx is taken over 432 dimensions and misses the energy outside Q, so each norm's weight
   becomes the constant sqrt(576/432 · e), with e the mean share of a unit input vector that Q
   keeps at that norm (measured): RMSNorm(z) then approximates Qᵀ RMSNorm(x) (a trial at full
   depth: 4.92 nats with this scale, 4.93 with sqrt(576/432) alone, 5.08 with weight 1).
   The final norm's weight is folded into lm_head, which is therefore untied from the
   embeddings (E diag(g) Q beside E Q). Keeping them tied, with the best diagonal norm weight
   in the sliced basis, cost about 3.5 nats in that trial: the final norm's weight has large
   and negative entries on outlier dimensions that one rotation spreads out.

Sizes: 20 layers, hidden 432, untied lm_head, 95.6M parameters (SmolLM2-135M: 30 layers,
hidden 576, tied, 134.5M).

Quality: mean next-token loss in nats (a uniform guess is ln 49153 = 10.80) on the 90 easy-vqa
test questions + answers as the LLaVA prompt lays them out (without the image; the questions
come from a few templates, so 47 of these texts also occur verbatim among the calibration
texts, which only choose the basis, nothing is trained) and on four generic chats the
derivation never sees; from
`OMP_NUM_THREADS=2 python -m fs_plugins.models.easyvqa_llava_small` (about 2 minutes):

    language model                   easy-vqa test   generic chat
    SmolLM2-135M (easyvqa_llava)             5.420          3.693
    20 kept layers, width 576                5.967          5.028   (measured separately)
    derived (easyvqa_llava_small)            5.824          5.503

Greedy generations (chat template; the last prompt raw):
    'What is the capital of France?'  'The capital of France is Paris.' | 'You are a Roman.'
    'Name a colour of the rainbow.'   'The Rainbow: A Miracle, a Rainbow, ...' | ''
    'USER: What shape is in the image? ASSISTANT:'
        'The image is a square with a length of 10 units.'
        | 'what is the universe? The universe: what is in the universe? ...' (newlines left out)
So it stays a language model (far below a uniform guess, close to the original on easy-vqa
text) but has lost most of its chat ability: dropping a third of the layers costs most of it.
The one-word easy-vqa answers are left to federated LoRA + projector training (not tried here).

The build (after `easyvqa_llava`'s) takes 20 s on 2 idle CPU cores (62 s beside another job),
most of it the calibration forward pass. Deterministic: fixed calibration texts, no random
draw except the projector's seeded initialisation.
"""
from __future__ import annotations

import logging
import math
import re

import numpy as np
import torch

from fs_plugins.core.cache import ensure_cached_dir
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.easyvqa import easyvqa_records
from fs_plugins.models.builders import LoadedBase, register_builder
from fs_plugins.models.codecs import LLAVA15_PROMPT
from fs_plugins.models.easyvqa_llava import easyvqa_llava_config, ensure_easyvqa_llava
from fs_plugins.models.vision_language import load_llava
from fs_plugins.schema.specs import ModelSpec

logger = logging.getLogger(__name__)

EASYVQA_LLAVA_SMALL_DIR_NAME = 'easyvqa-llava-smollm2-small-v1'
# `python -m fs_plugins.models.easyvqa_llava_small --choose-layers` dropped, in this order,
# 4, 22, 12, 14, 17, 16, 6, 13, 26, 25
KEPT_LAYERS = (0, 1, 2, 3, 5, 7, 8, 9, 10, 11, 15, 18, 19, 20, 21, 23, 24, 27, 28, 29)
SMALL_HIDDEN_SIZE = 432
CALIBRATION = dict(easyvqa_texts=128, seed=0, batch_size=32)
LAYER_SELECTION = dict(easyvqa_texts=48, seed=1, keep_ends=2)

# Short chat exchanges written for this module: calibration keeps the generic (non easy-vqa)
# directions of the residual stream; the held-out ones only measure quality.
GENERIC_CALIBRATION = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Give me three tips for staying healthy.",
     "1. Eat a balanced diet with plenty of fruit and vegetables.\n2. Exercise regularly.\n"
     "3. Get enough sleep every night."),
    ("Explain what photosynthesis is in one sentence.",
     "Photosynthesis is the process by which plants use sunlight, water and carbon dioxide to "
     "make sugar and release oxygen."),
    ("Write a short poem about the sea.",
     "The sea rolls in with silver light,\nit hums and whispers through the night."),
    ("How many days are there in a week?", "There are seven days in a week."),
    ("Translate 'good morning' into Spanish.", "'Good morning' in Spanish is 'buenos días'."),
    ("What is 12 times 7?", "12 times 7 is 84."),
    ("Describe a cat.", "A cat is a small furry animal with whiskers, sharp claws and a long "
     "tail. Cats are popular pets."),
    ("Summarise why people recycle.", "People recycle to save raw materials and energy, and to "
     "keep waste out of landfills and the ocean."),
    ("Suggest a name for a bakery.", "How about 'The Golden Crust'?"),
]
GENERIC_HELD_OUT = [
    ("What colour is the sky on a clear day?", "On a clear day the sky is blue."),
    ("Name two planets in our solar system.",
     "Two planets in our solar system are Mars and Jupiter."),
    ("Why do we need to drink water?", "We need water because our bodies use it to regulate "
     "temperature, carry nutrients and remove waste."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
]


# ------------------------------------------------------------------ texts
def easyvqa_text(record: dict, end_text: str) -> str:
    """A record as the language model sees it in training, without the image tokens."""
    return (LLAVA15_PROMPT.format(images='', question=record['question'])
            + f" {record['answer']}{end_text}")


def chat_text(tokenizer, question: str, answer: str) -> str:
    return tokenizer.apply_chat_template([{'role': 'user', 'content': question},
                                          {'role': 'assistant', 'content': answer}],
                                         tokenize=False)


def calibration_texts(tokenizer) -> list[str]:
    """A seeded sample of easy-vqa train texts plus the generic calibration chats."""
    train = [r for r in easyvqa_records() if r['split'] == 'train']
    chosen = np.random.default_rng(CALIBRATION['seed']).choice(
        len(train), CALIBRATION['easyvqa_texts'], replace=False)
    return ([easyvqa_text(train[i], tokenizer.eos_token) for i in sorted(chosen)]
            + [chat_text(tokenizer, q, a) for q, a in GENERIC_CALIBRATION])


def held_out_texts(tokenizer) -> dict[str, list[str]]:
    """Quality texts: the easy-vqa test records (templated, so many equal train texts) and
    generic chats the derivation never sees."""
    test = [r for r in easyvqa_records() if r['split'] == 'test']
    return {'easy-vqa test': [easyvqa_text(r, tokenizer.eos_token) for r in test],
            'generic chat': [chat_text(tokenizer, q, a) for q, a in GENERIC_HELD_OUT]}


def layer_selection_texts(tokenizer) -> list[str]:
    """Easy-vqa train texts outside the calibration sample (seeded) plus the generic
    calibration chats: what the layers to drop were chosen on."""
    calibration = set(calibration_texts(tokenizer))
    unseen = [text for text in (easyvqa_text(r, tokenizer.eos_token) for r in easyvqa_records()
                                if r['split'] == 'train') if text not in calibration]
    chosen = np.random.default_rng(LAYER_SELECTION['seed']).choice(
        len(unseen), LAYER_SELECTION['easyvqa_texts'], replace=False)
    return ([unseen[i] for i in sorted(chosen)]
            + [chat_text(tokenizer, q, a) for q, a in GENERIC_CALIBRATION])


def token_batches(tokenizer, texts: list[str], batch_size: int = CALIBRATION['batch_size']):
    """(input_ids, attention_mask) batches, right-padded."""
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer(texts[start:start + batch_size], return_tensors='pt', padding=True)
        yield encoded['input_ids'], encoded['attention_mask']


@torch.no_grad()
def mean_token_loss(model, tokenizer, texts: list[str]) -> float:
    """Mean next-token cross-entropy (nats) over all real tokens of `texts`."""
    total, count = 0.0, 0
    for ids, mask in token_batches(tokenizer, texts):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                   targets.flatten(), reduction='sum').item()
        count += int((targets != -100).sum())
    return total / count


# ------------------------------------------------------------------ derivation
def drop_layers(model, kept: tuple[int, ...]) -> None:
    """Keeps only the decoder layers `kept` (in place), renumbering them for the KV cache."""
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in kept)
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = index
    model.config.num_hidden_layers = len(kept)


def greedy_layer_drop(model, tokenizer, texts: list[str], count: int,
                      keep_ends: int = LAYER_SELECTION['keep_ends']) -> list[int]:
    """The `count` layers to drop, chosen greedily: each step drops the layer whose removal
    raises the mean token loss on `texts` least; the first and last `keep_ends` layers stay.
    How KEPT_LAYERS was chosen (slow: about half an hour on 2 CPU cores)."""
    layers, total = model.model.layers, model.config.num_hidden_layers
    dropped: list[int] = []
    try:
        for _ in range(count):
            losses = {}
            for candidate in range(keep_ends, total - keep_ends):
                if candidate not in dropped:
                    model.model.layers = torch.nn.ModuleList(
                        layers[i] for i in range(total) if i not in dropped + [candidate])
                    model.config.num_hidden_layers = len(model.model.layers)
                    losses[candidate] = mean_token_loss(model, tokenizer, texts)
            dropped.append(min(losses, key=losses.get))
            logger.info(f"dropping layer {dropped[-1]}: loss {losses[dropped[-1]]:.4f}")
    finally:
        model.model.layers, model.config.num_hidden_layers = layers, total
    return dropped


def rms_norm_names(model) -> list[str]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    return [name for name, module in model.named_modules() if isinstance(module, LlamaRMSNorm)]


@torch.no_grad()
def residual_stream_covariances(model, tokenizer, texts) -> dict[str, torch.Tensor]:
    """For every RMSNorm (by module name): the second moment of its input, the residual
    stream, over all real tokens of `texts`, each token's vector scaled to unit length."""
    names = rms_norm_names(model)
    modules = dict(model.named_modules())
    width = model.config.hidden_size
    sums = {name: torch.zeros(width, width, dtype=torch.float64) for name in names}
    inputs: dict[str, torch.Tensor] = {}

    def keep_input(name):
        return lambda module, args: inputs.__setitem__(name, args[0])
    hooks = [modules[name].register_forward_pre_hook(keep_input(name)) for name in names]
    tokens = 0
    try:
        for ids, mask in token_batches(tokenizer, texts):
            model.model(input_ids=ids, attention_mask=mask, use_cache=False)
            real = mask.bool()
            for name, stream in inputs.items():
                vectors = torch.nn.functional.normalize(stream[real], dim=-1)
                sums[name] += (vectors.T @ vectors).double()
            tokens += int(real.sum())
    finally:
        for hook in hooks:
            hook.remove()
    return {name: total / tokens for name, total in sums.items()}


def principal_basis(covariance: torch.Tensor, width: int) -> torch.Tensor:
    """The top `width` eigenvectors of `covariance` as columns, each signed so that its
    largest entry is positive (eigh's signs are arbitrary)."""
    values, vectors = torch.linalg.eigh(covariance)
    basis = vectors[:, torch.argsort(values, descending=True)[:width]]
    largest = basis.abs().argmax(0)
    return basis * torch.sign(basis[largest, torch.arange(width)])


def reading_norm(name: str) -> str | None:
    """The RMSNorm whose output the residual-reading weight `name` reads (None: embeddings)."""
    layer = re.match(r'model\.layers\.(\d+)\.', name)
    if name.endswith(('q_proj.weight', 'k_proj.weight', 'v_proj.weight')):
        return f'model.layers.{layer[1]}.input_layernorm'
    if name.endswith(('gate_proj.weight', 'up_proj.weight')):
        return f'model.layers.{layer[1]}.post_attention_layernorm'
    return 'model.norm' if name == 'lm_head.weight' else None


READS_RESIDUAL = ('embed_tokens.weight', 'q_proj.weight', 'k_proj.weight', 'v_proj.weight',
                  'gate_proj.weight', 'up_proj.weight', 'lm_head.weight')
WRITES_RESIDUAL = ('o_proj.weight', 'down_proj.weight')


def small_llama_config(config, width: int):
    from transformers import LlamaConfig
    fields = {k: v for k, v in config.to_dict().items()
              if k not in ('quantization_config', '_name_or_path', '_model_name_or_path')}
    fields.update(hidden_size=width, head_dim=config.head_dim, tie_word_embeddings=False)
    return LlamaConfig(**fields)


@torch.no_grad()
def sliced_state_dict(model, basis: torch.Tensor,
                      covariances: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model`'s weights with the RMSNorm weights folded into the readers, rotated and sliced
    by `basis`; each norm's weight becomes the constant that restores the RMS scale."""
    full, width = basis.shape
    state = {name: tensor.double() for name, tensor in model.state_dict().items()}
    if 'lm_head.weight' not in state:  # tied: lm_head gets its own copy to fold into
        state['lm_head.weight'] = state['model.embed_tokens.weight']
    sliced = {}
    for name, weight in state.items():
        if name.endswith(READS_RESIDUAL):
            norm = reading_norm(name)
            folded = weight * state[f'{norm}.weight'] if norm else weight
            sliced[name] = folded @ basis
        elif name.endswith(WRITES_RESIDUAL):
            sliced[name] = basis.T @ weight
        elif name.removesuffix('.weight') in covariances:
            kept_energy = torch.trace(basis.T @ covariances[name.removesuffix('.weight')] @ basis)
            sliced[name] = torch.full((width,), math.sqrt(full / width * float(kept_energy)))
        else:
            sliced[name] = weight
    return {name: tensor.float() for name, tensor in sliced.items()}


def derive_small_llama(model, tokenizer, kept_layers=KEPT_LAYERS, width=SMALL_HIDDEN_SIZE):
    """The shallower, narrower LlamaForCausalLM derived from `model` (whose layers are dropped
    in place: pass a copy you can spare)."""
    from transformers import LlamaForCausalLM
    model.eval()
    drop_layers(model, kept_layers)
    covariances = residual_stream_covariances(model, tokenizer, calibration_texts(tokenizer))
    basis = principal_basis(sum(covariances.values()) / len(covariances), width)
    small = LlamaForCausalLM(small_llama_config(model.config, width))
    small.load_state_dict(sliced_state_dict(model, basis, covariances))
    small.generation_config = model.generation_config
    return small.eval()


# ------------------------------------------------------------------ the LLaVA folder
def language_model_of(llava):
    """The LlamaForCausalLM inside a LlavaForConditionalGeneration (a copy of its weights)."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM(llava.config.text_config)
    model.model.load_state_dict(llava.model.language_model.state_dict())
    model.lm_head.load_state_dict(llava.lm_head.state_dict())
    return model.eval()


def build_easyvqa_llava_small_dir(path: str, seed: int = 1234) -> None:
    """`easyvqa_llava`'s folder with the derived language model and a fresh seeded projector:
    same trained vision tower (copied), processor, tokenizer and chat template."""
    from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration
    source = ensure_easyvqa_llava()
    llava = LlavaForConditionalGeneration.from_pretrained(source)
    # a tokenizer of its own: padding calibration batches changes the saved tokenizer settings
    small = derive_small_llama(language_model_of(llava), AutoTokenizer.from_pretrained(source))
    config = easyvqa_llava_config(small.config, llava.config.image_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, 'easyvqa_llava_small'))
        model = LlavaForConditionalGeneration(config)
    model.model.vision_tower.load_state_dict(llava.model.vision_tower.state_dict())
    model.model.language_model.load_state_dict(small.model.state_dict())
    model.lm_head.load_state_dict(small.lm_head.state_dict())
    model.generation_config = llava.generation_config
    model.save_pretrained(path)
    AutoProcessor.from_pretrained(source).save_pretrained(path)


def ensure_easyvqa_llava_small(path: str | None = None) -> str:
    return ensure_cached_dir(path, build_easyvqa_llava_small_dir, EASYVQA_LLAVA_SMALL_DIR_NAME)


@register_builder('easyvqa_llava_small')
def load_easyvqa_llava_small(spec: ModelSpec, path: str) -> LoadedBase:
    """`path` 'smollm2-small' (or '') uses the cached folder, built on first use."""
    folder = None if path in ('', 'smollm2-small') else path
    return load_llava(spec, ensure_easyvqa_llava_small(folder))


# ------------------------------------------------------------------ quality report
GENERATION_PROMPTS = ['What is the capital of France?', 'Name a colour of the rainbow.',
                      'USER: What shape is in the image? ASSISTANT:']


@torch.no_grad()
def greedy_generation(model, tokenizer, prompt: str, max_new_tokens: int = 20) -> str:
    text = prompt if prompt.startswith('USER:') else tokenizer.apply_chat_template(
        [{'role': 'user', 'content': prompt}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors='pt')['input_ids']
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def quality_report() -> None:
    """Prints the original and the derived language model's held-out losses and a few greedy
    generations (builds both folders first if needed)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    folders = {'SmolLM2-135M (easyvqa_llava)': ensure_easyvqa_llava(),
               'derived (easyvqa_llava_small)': ensure_easyvqa_llava_small()}
    tokenizer = AutoProcessor.from_pretrained(folders['SmolLM2-135M (easyvqa_llava)']).tokenizer
    texts = held_out_texts(tokenizer)
    print(f"uniform guess: ln {len(tokenizer)} = {math.log(len(tokenizer)):.2f}")
    for label, folder in folders.items():
        model = language_model_of(LlavaForConditionalGeneration.from_pretrained(folder))
        losses = {name: mean_token_loss(model, tokenizer, group) for name, group in texts.items()}
        millions = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"{label}: {model.config.num_hidden_layers} layers, hidden "
              f"{model.config.hidden_size}, {millions:.1f}M parameters; "
              + ', '.join(f"{n} loss {v:.3f}" for n, v in losses.items()))
        for prompt in GENERATION_PROMPTS:
            print(f"  {prompt!r} -> {greedy_generation(model, tokenizer, prompt)!r}")


def print_layer_drop_order() -> None:
    from transformers import AutoTokenizer, LlavaForConditionalGeneration
    source = ensure_easyvqa_llava()
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = language_model_of(LlavaForConditionalGeneration.from_pretrained(source))
    count = model.config.num_hidden_layers - len(KEPT_LAYERS)
    print(greedy_layer_drop(model, tokenizer, layer_selection_texts(tokenizer), count))


if __name__ == '__main__':
    import sys
    logging.basicConfig(level=logging.INFO)
    if '--choose-layers' in sys.argv[1:]:
        print_layer_drop_order()
    else:
        quality_report()
