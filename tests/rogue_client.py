"""A dishonest FS client for the tests: `python rogue_client.py MARKER --cfg client.yaml`.

Default mode: it trains like an honest client but sends, instead of its update, pickled
payloads that would create the file MARKER if the server unpickled them: in round 0 a pickle
under a `shared/` key (the old encoding), later a pickle as the whole safetensors payload.

`ROGUE_MODE=attacks`: an enrolled client (its own valid token) whose update of round t is
forged by attack t of ATTACKS (issue 41), and which also sends, every round, a message type FS
does not know, metrics that are not a dict and a message with a timestamp below the server's.
MARKER is then unused."""
import base64
import os
import pickle
import struct
import sys

import torch
from federatedscope.core.message import Message
from helpers import CreatesFile

import fs_plugins.fs.workers as workers
from fs_plugins.commands.cli import main
from fs_plugins.fs.wire import DATASET_SIZE, MARKER, PAYLOAD, SHARED, from_blob, to_blob


def forged_update(marker: str):
    sent = []

    def encode(update, distributed):
        evil = base64.b64encode(pickle.dumps(CreatesFile(marker))).decode()
        sent.append(1)
        if len(sent) == 1:
            return {MARKER: 1, 'shared/' + next(iter(update.shared)): evil}
        return {MARKER: 1, PAYLOAD: evil}
    return encode


def _nested_header(flat):
    header = b'{"a":' * 100_000 + b'1' + b'}' * 100_000
    return base64.b64encode(struct.pack('<Q', len(header)) + header).decode()


def _set(key, value):
    def forge(flat):
        flat[key] = value
        return to_blob(flat)
    return forge


def _first_shared(make):
    def forge(flat):
        name = next(k for k in flat if k.startswith(SHARED))
        flat[name] = make(flat[name])
        return to_blob(flat)
    return forge


def _extra_name(flat):
    flat[SHARED + 'base_model.model.lm_head.evil.weight'] = torch.ones(4)
    return to_blob(flat)


# (name, forge: the honest update's flat dict -> the payload sent, what the server's reason
# says); the test checks that the server rejects each, in this order, one per round
ATTACKS = [
    ('nested_header', _nested_header, 'unreadable header'),
    ('infinite_dataset_size', _set(DATASET_SIZE, float('inf')), 'dataset_size = inf is not a whole number'),
    ('zero_dataset_size', _set(DATASET_SIZE, 0), 'dataset_size = 0 is not in [1'),
    ('huge_dataset_size', _set(DATASET_SIZE, 10 ** 15), 'dataset_size = 1000000000000000 is not in [1'),
    ('wrong_shape', _first_shared(lambda t: torch.zeros(t.shape[0] + 1, *t.shape[1:])), 'has shape'),
    ('int64_values', _first_shared(lambda t: torch.full(t.shape, 10 ** 9, dtype=torch.int64)),
     'has dtype int64, expected float32'),
    ('huge_values', _first_shared(lambda t: torch.full(t.shape, 1e6)), 'max_update_norm'),
    ('extra_tensor_name', _extra_name, 'unexpected shared tensor(s) base_model.model.lm_head.evil'),
]


def attacking_update():
    sent = []

    def encode(update, distributed):
        honest = encode_honest(update, distributed)
        name, forge, _ = ATTACKS[len(sent) % len(ATTACKS)]
        sent.append(name)
        return {MARKER: 1, PAYLOAD: forge(from_blob(honest[PAYLOAD], 'the rogue'))}
    return encode


def with_bad_messages(train_and_send):
    def callback(self, message):
        train_and_send(self, message)
        server = message.sender
        for msg_type, content, timestamp in (('fsplug_bogus', {MARKER: 1}, message.timestamp),
                                             ('metrics', 'not a dict', message.timestamp),
                                             ('metrics', {MARKER: 1}, -1e9)):
            self.comm_manager.send(Message(msg_type=msg_type, sender=self.ID, receiver=[server],
                                           state=message.state, timestamp=timestamp,
                                           content=content))
    return callback


encode_honest = workers.encode_update

if __name__ == '__main__':
    if os.environ.get('ROGUE_MODE') == 'attacks':
        workers.encode_update = attacking_update()
        workers.PluginClient.callback_funcs_for_model_para = with_bad_messages(
            workers.PluginClient.callback_funcs_for_model_para)
    else:
        workers.encode_update = forged_update(os.path.abspath(sys.argv[1]))
    sys.exit(main(['run', '--runner', 'fs'] + sys.argv[2:]))
