"""Test-only, imported into an FS run through fsplug.import_modules (tests/test_nbafl.py,
tests/test_fs_half.py): writes under $FSPLUG_PROBE_DIR what the FS server receives from each
client and, after each local round, the client's model as it stands (its shared tensors
before NbAFL, its frozen base and the precision of the trainer's model)."""
import os

import torch

from fs_plugins.fs import workers

OUT = os.environ['FSPLUG_PROBE_DIR']

_decoded_updates = workers.PluginServer._decoded_updates
_train_and_send = workers.PluginClient.callback_funcs_for_model_para


def _received(self, buffer):
    updates = _decoded_updates(self, buffer)
    for update in updates:
        torch.save(dict(update.shared), os.path.join(OUT, f'received_r{self.state}_c{update.client_id}.pt'))
    return updates


def _client_after_round(self, message):
    _train_and_send(self, message)
    proc = self.trainer.procedure
    trainable = set(proc.trainable_names)
    torch.save({'shared': proc.method.shared_tensors(proc.model, proc.trainable_names),
                'trainable': {n: p.detach().clone() for n, p in proc.model.named_parameters()
                              if n in trainable},
                'frozen': {n: p.detach().clone() for n, p in proc.model.named_parameters()
                           if n not in trainable},
                'ctx_model_dtypes': sorted({str(p.dtype) for p in self.trainer.ctx.model.parameters()}),
                'dataset_size': len(proc.train_data)},
               os.path.join(OUT, f'client_r{self.state}_c{self.ID}.pt'))


workers.PluginServer._decoded_updates = _received
workers.PluginClient.callback_funcs_for_model_para = _client_after_round
