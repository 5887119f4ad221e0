"""A dishonest FS client for the tests: `python rogue_client.py MARKER --cfg client.yaml`.

It trains like an honest client but sends, instead of its update, pickled payloads that would
create the file MARKER if the server unpickled them: in round 0 a pickle under a `shared/`
key (the old encoding), later a pickle as the whole safetensors payload."""
import base64
import os
import pickle
import sys

from helpers import CreatesFile

import fs_plugins.fs.workers as workers
from fs_plugins.commands.cli import main
from fs_plugins.fs.wire import MARKER, PAYLOAD


def forged_update(marker: str):
    sent = []

    def encode(update, distributed):
        evil = base64.b64encode(pickle.dumps(CreatesFile(marker))).decode()
        sent.append(1)
        if len(sent) == 1:
            return {MARKER: 1, 'shared/' + next(iter(update.shared)): evil}
        return {MARKER: 1, PAYLOAD: evil}
    return encode


if __name__ == '__main__':
    marker = os.path.abspath(sys.argv[1])
    workers.encode_update = forged_update(marker)
    sys.exit(main(['run', '--runner', 'fs'] + sys.argv[2:]))
