"""What the fsplug workers send over FS's gRPC (fs_plugins.fs.wire): safetensors + JSON, never
pickle; every malformed payload is a WireError naming the sender. Runs without FS."""
import base64
import pickle

import pytest
import torch
from helpers import CreatesFile

from fs_plugins.fs.wire import (
    MARKER,
    PAYLOAD,
    WireError,
    decode_tensors,
    decode_update,
    decoded_updates,
    encode_tensors,
    encode_update,
    from_blob,
    to_blob,
)
from fs_plugins.methods.base import ClientUpdate


def _update():
    base = torch.randn(6, 4)
    shared = {'a.lora_A': base[:2],                      # a view: copied, not refused
              'a.lora_B': torch.randn(4, 3).to(torch.bfloat16),
              'same': base[:2]}                          # shares storage with the first
    return ClientUpdate(3, 12, shared, {'grad': torch.arange(5)}, {'loss': 0.1234567891234},
                        dataset_size=40)


def test_a_rounds_updates_are_decoded_in_client_order_whatever_their_arrival():
    """The server aggregates in client id order (as the embedded runner does), so a run over
    the network gives the same numbers whichever update arrived first."""
    arrived = {cid: (12, encode_update(_update(), True)) for cid in (3, 1, 2)}
    arrived['4'] = (12, {'garbled': 1})
    rejected = []
    updates = decoded_updates(arrived, lambda cid, reason: rejected.append(cid))
    assert [u.client_id for u in updates] == [1, 2, 3] and rejected == [4]


@pytest.mark.parametrize('distributed', [False, True])
def test_update_round_trip_is_exact(distributed):
    update = _update()
    content = encode_update(update, distributed)
    if distributed:
        assert set(content) == {MARKER, PAYLOAD} and isinstance(content[PAYLOAD], str)
    got = decode_update(3, 12, content)
    assert got.shared.keys() == update.shared.keys()
    for name, tensor in update.shared.items():
        assert got.shared[name].dtype == tensor.dtype and torch.equal(got.shared[name], tensor)
    assert torch.equal(got.extra['grad'], update.extra['grad'])
    assert got.metrics == update.metrics        # float64 in JSON, not FS's float32
    assert (got.client_id, got.num_samples, got.dataset_size) == (3, 12, 40)


def test_server_content_round_trip():
    tensors = {'w': torch.randn(3, 3)}
    assert torch.equal(decode_tensors(encode_tensors(tensors, True))['w'], tensors['w'])


def test_only_tensors_and_json_scalars_are_encoded():
    with pytest.raises(TypeError, match="'shared/x' is a list"):
        to_blob({'shared/x': [1, 2]})


@pytest.mark.parametrize('where', ['shared value', 'payload'])
def test_pickles_are_never_unpickled(tmp_path, where):
    marker = tmp_path / 'pwned'
    evil = base64.b64encode(pickle.dumps(CreatesFile(str(marker)))).decode()
    content = {MARKER: 1, 'shared/w': evil} if where == 'shared value' else {MARKER: 1, PAYLOAD: evil}
    with pytest.raises(WireError, match='client 7'):
        decode_update(7, 1, content)
    assert not marker.exists()


@pytest.mark.parametrize('payload, message', [
    ('not base64!', 'is not base64'),
    (base64.b64encode(b'abc').decode(), 'is not a safetensors blob'),
    (base64.b64encode((10 ** 9).to_bytes(8, 'little') + b'{}').decode(), 'header of 1000000000 bytes'),
    (base64.b64encode((2).to_bytes(8, 'little') + b'\xff\xfe').decode(), 'unreadable header'),
    (base64.b64encode((2).to_bytes(8, 'little') + b'[]').decode(), 'unreadable header'),
    (12, "'fsplug/payload' is a int"),
])
def test_malformed_payloads_name_the_sender(payload, message):
    with pytest.raises(WireError, match=message) as caught:
        decode_update(5, 1, {MARKER: 1, PAYLOAD: payload})
    assert 'client 5' in str(caught.value)


def test_non_scalar_metadata_is_refused():
    from safetensors.torch import save
    blob = base64.b64encode(save({}, metadata={'fsplug_scalars': '{"x": [1]}'})).decode()
    with pytest.raises(WireError, match="'x' is a list"):
        from_blob(blob, 'client 2')


def test_content_that_is_not_a_dict_is_named():
    with pytest.raises(WireError, match='content from client 4 is a str'):
        decode_update(4, 1, 'hello')
