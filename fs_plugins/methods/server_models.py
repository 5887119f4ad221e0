"""What the public-set distillation methods (FedMKT, TAKFL) share on the server: a copy of
each participant architecture's model, the public records encoded by its tokenizer, the MinED
token alignment between two architectures, a measuring pass (per-sample answer losses and
prompt-end logits) and an optimisation loop over the public set with a per-batch loss.

A subclass's config node (fsplug.<name>) declares public_data, public_samples, kd_batch_size,
kd_lr and kd_epochs; its public records are drawn with the seed tag '<name>-public'."""
from __future__ import annotations

from collections.abc import Callable

import torch

from fs_plugins.aggregation.fedmkt import (
    answer_losses,
    min_edit_distance_alignment,
    prompt_end_rows,
)
from fs_plugins.core.errors import ConfigError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.instruction import IGNORE_INDEX
from fs_plugins.data.public import public_records
from fs_plugins.methods.base import Method, load_tensors
from fs_plugins.methods.building import build_model
from fs_plugins.methods.specs import data_source, device_for, split_spec
from fs_plugins.schema.options import to_plain

# (logits, labels, rows) -> the loss of one public batch; rows: the slice of public samples
# (rows of the per-sample teacher tensors) the batch holds
BatchLoss = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]


def architecture_key(cfg) -> str:
    """The key of a participant's model: its model.type and fsplug.model node."""
    return repr((to_plain(cfg.model.type), to_plain(cfg.fsplug.model)))


class ServerModels(Method):
    """A method whose server runs a copy of every participant architecture on the public set."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self._models: dict = {}       # architecture key -> (BuiltModel, public batches)
        self._alignments: dict = {}   # (source key, target key) -> token index map

    def architecture(self, cfg) -> str:
        """architecture_key(cfg), its model built (once) on the server with its public batches."""
        key = architecture_key(cfg)
        if key not in self._models:
            built = build_model(cfg, type(self)(cfg))
            built.model.to(device_for(cfg))
            self._models[key] = (built, self.public_batches(built.codec, cfg))
        return key

    def public_batches(self, codec, cfg) -> list[dict]:
        """The public records, encoded by `codec` (the same records for every model)."""
        hp, node = self.hparams, f'fsplug.{self.name}.public_data'
        records = public_records(hp.public_data, data_source(self.cfg), hp.public_samples,
                                 derive_seed(self.cfg.seed, f'{self.name}-public'), node,
                                 split_spec(self.cfg))
        examples = [codec.encode(r) for r in records]
        dropped = sum(e is None for e in examples)
        if dropped:
            raise ConfigError(f'{node}: {dropped} public record(s) leave no answer token within '
                              f'llm.tok_len for model {cfg.model.type}')
        size = hp.kd_batch_size
        return [codec.collate(examples[i:i + size]) for i in range(0, len(examples), size)]

    def alignment(self, source_key: str, target_key: str) -> torch.Tensor:
        """Source token id -> target token id (MinED), computed once per pair of models."""
        pair = (source_key, target_key)
        if pair not in self._alignments:
            source, target = (self._models[k][0].codec.tokenizer for k in pair)
            tokens = [tok.convert_ids_to_tokens(list(range(len(tok)))) for tok in (source, target)]
            self._alignments[pair] = (torch.arange(len(tokens[0])) if tokens[0] == tokens[1]
                                      else min_edit_distance_alignment(*tokens))
        return self._alignments[pair]

    def measure(self, key: str, lora: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample answer losses, prompt-end logits) of model `key` with `lora` on the
        public set, on the CPU in float32."""
        built, batches = self._models[key]
        model = built.model
        load_tensors(model, lora)
        model.eval()
        losses, logits = [], []
        with torch.no_grad():
            for batch in batches:
                out, labels = self.forward(model, batch)
                losses.append(answer_losses(out, labels, IGNORE_INDEX).cpu())
                logits.append(prompt_end_rows(out, labels, IGNORE_INDEX).float().cpu())
        return torch.cat(losses), torch.cat(logits)

    def model_size(self, key: str) -> int:
        """Parameters of model `key` (base and adapter)."""
        return sum(p.numel() for p in self._models[key][0].model.parameters())

    def initial_lora(self, key: str) -> dict:
        """Model `key`'s trained tensors as built (its initial adapter), on the CPU."""
        built = self._models[key][0]
        params = dict(built.model.named_parameters())
        return {n: params[n].detach().to('cpu').clone() for n in built.trainable_names}

    def public_accuracy(self, key: str, lora: dict) -> float:
        """Answer-token accuracy of model `key` with `lora` on the labelled public set (the
        share of answer tokens predicted exactly, over all its records)."""
        built, batches = self._models[key]
        model = built.model
        load_tensors(model, lora)
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for batch in batches:
                out, labels = self.forward(model, batch)
                predicted, targets = out[:, :-1].argmax(-1), labels[:, 1:].to(out.device)
                scored = targets != IGNORE_INDEX
                correct += int((predicted.eq(targets) & scored).sum())
                total += int(scored.sum())
        return correct / max(total, 1)

    @staticmethod
    def forward(model, batch: dict):
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop('labels')
        return model(**batch).logits, labels

    def train_on_public(self, key: str, lora: dict, batch_loss: BatchLoss,
                        seed_tags: tuple) -> dict:
        """`lora` on model `key` trained for kd_epochs passes over the public set (Adam at
        kd_lr, 0: the training rate) on `batch_loss`; the other parameters stay frozen."""
        built, batches = self._models[key]
        model, hp = built.model, self.hparams
        device = next(model.parameters()).device
        load_tensors(model, lora)
        names = set(lora)
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        for name, param in model.named_parameters():
            param.requires_grad_(name in names)
        optimizer = torch.optim.Adam([p for n, p in model.named_parameters() if n in names],
                                     lr=hp.kd_lr or float(self.cfg.train.optimizer.lr))
        starts = [0]
        for batch in batches:
            starts.append(starts[-1] + batch['input_ids'].shape[0])
        model.train()
        # the distillation's dropout draws from its own seed, not from the clients' stream
        with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []):
            torch.manual_seed(derive_seed(self.cfg.seed, *seed_tags))
            for _ in range(hp.kd_epochs):
                for batch, start, end in zip(batches, starts, starts[1:]):
                    logits, labels = self.forward(model, batch)
                    loss = batch_loss(logits, labels, slice(start, end))
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])
        return {n: p.detach().to('cpu').clone() for n, p in model.named_parameters() if n in names}
