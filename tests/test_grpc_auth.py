"""Authentication before the body (fs_plugins.fs.secure): a refused call is never parsed or
decompressed, compressed bodies are inflated only after the check and within the receive
limit, the server's receive limit follows its model, and a party's certificate cannot pass as
another's. Certificates made in the test, on 127.0.0.1; skipped where FederatedScope (with
grpcio) is not installed."""
import os

import pytest

pytest.importorskip('federatedscope')
grpc = pytest.importorskip('grpc')
pytestmark = pytest.mark.fs   # the fs tier

from fs_plugins.commands.credentials import make_credentials, party_distribute  # noqa: E402
from fs_plugins.fs import secure  # noqa: E402
from fs_plugins.fs.secure import (  # noqa: E402
    SENDER_METADATA,
    TOKEN_METADATA,
    CredentialsRefused,
    party_comm_manager,
    received_message_bound,
    tensor_bytes,
)

BIG = 24 * 2 ** 20


@pytest.fixture(scope='module')
def creds(tmp_path_factory):
    return make_credentials(str(tmp_path_factory.mktemp('creds')), [1, 2])


@pytest.fixture
def deserialized(monkeypatch):
    """Counts FS's request deserializer (MessageRequest.FromString) on every listener made
    in the test: [calls]."""
    from federatedscope.core.proto import gRPC_comm_manager_pb2 as pb2
    from federatedscope.core.proto import gRPC_comm_manager_pb2_grpc as pb2_grpc
    calls = [0]

    class CountingRequest:
        SerializeToString = staticmethod(pb2.MessageRequest.SerializeToString)

        @staticmethod
        def FromString(data):
            calls[0] += 1
            return pb2.MessageRequest.FromString(data)

    counting = type('CountingPb2', (), {'MessageRequest': CountingRequest,
                                        'MessageResponse': pb2.MessageResponse})
    monkeypatch.setattr(pb2_grpc, 'gRPC__comm__manager__pb2', counting)
    return calls


@pytest.fixture
def inflations(monkeypatch):
    calls = [0]
    real = secure.inflated

    def counting(body, limit):
        calls[0] += 1
        return real(body, limit)
    monkeypatch.setattr(secure, 'inflated', counting)
    return calls


@pytest.fixture
def parties():
    made = []

    def make(folder, name, auth, server=None, token_of=None, receive_limit=None):
        distribute = dict(party_distribute(folder, name, auth), connect_timeout_s=3.0)
        if token_of:
            distribute['token_file'] = os.path.join(folder, f'{token_of}.token')
        manager = party_comm_manager('server' if name == 'server' else 'client', distribute,
                                     receive_limit=receive_limit)
        made.append(manager)
        if server is not None:
            manager.add_neighbors(0, f'127.0.0.1:{server.port}')
        return manager
    yield make
    for manager in made:
        manager.grpc_server.stop(0)


def _message(sender, receiver, content='x', msg_type='join_in'):
    from federatedscope.core.message import Message
    return Message(msg_type=msg_type, sender=sender, receiver=[receiver], state=0, timestamp=0,
                   content=content)


@pytest.mark.parametrize('token_of', ['client_2', 'none'])
def test_a_wrong_or_missing_token_is_refused_before_the_body_is_parsed(
        parties, creds, deserialized, inflations, token_of):
    server = parties(creds, 'server', 'token')
    # 'none': client 1 dials with its certificate but sends no token
    client = (parties(creds, 'client_1', 'token', server, token_of=token_of) if token_of != 'none'
              else parties(creds, 'client_1', 'certificate', server))
    client.comp_method = grpc.Compression.Gzip   # a compressed body is not inflated either
    with pytest.raises(CredentialsRefused, match='token'):
        client.send(_message(1, 0, content='x' * BIG))
    assert deserialized[0] == 0 and inflations[0] == 0
    assert server.server_funcs.refused == 1 and not server.server_funcs.msg_queue


def test_an_accepted_compressed_body_is_inflated_after_the_check(parties, creds, deserialized):
    server = parties(creds, 'server', 'token')
    client = parties(creds, 'client_1', 'token', server)
    client.comp_method = grpc.Compression.Gzip   # distribute.grpc_compression: gzip
    client.send(_message(1, 0, content='y' * 2 ** 20))
    received = server.receive(timeout=10)
    assert (received.sender, received.content) == (1, 'y' * 2 ** 20)
    assert deserialized[0] == 1


def test_a_body_inflating_past_the_receive_limit_is_refused(parties, creds, deserialized):
    server = parties(creds, 'server', 'token', receive_limit=2 ** 20)
    client = parties(creds, 'client_1', 'token', server)
    client.comp_method = grpc.Compression.Deflate
    with pytest.raises(ConnectionError, match='inflates to over'):
        client.send(_message(1, 0, content='z' * 8 * 2 ** 20))   # ~8 KiB once deflated
    assert deserialized[0] == 0 and not server.server_funcs.msg_queue


def test_a_message_must_name_the_sender_it_was_authenticated_as(parties, creds):
    server = parties(creds, 'server', 'token')
    client = parties(creds, 'client_1', 'token', server)
    request = _message(2, 0).transform(to_list=True)   # client 1's token, client 2's id
    stub = client._stub(f'127.0.0.1:{server.port}', 0)
    with pytest.raises(grpc.RpcError) as refused:
        stub.sendMessage(request, metadata=((SENDER_METADATA, '1'),
                                            (TOKEN_METADATA, client.credentials.own_token)))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert 'authenticated as client 1' in refused.value.details()
    assert not server.server_funcs.msg_queue


@pytest.mark.parametrize('auth', ['token', 'certificate'])
def test_a_client_certificate_cannot_pass_as_the_server(parties, creds, auth):
    impostor = parties(creds, 'client_2', auth)   # listens with client 2's certificate
    client = parties(creds, 'client_1', auth, impostor)
    with pytest.raises(ConnectionError, match="certificate is not the server's"):
        client.send(_message(1, 0))
    assert impostor.server_funcs.refused == 0 and not impostor.server_funcs.msg_queue
    server = parties(creds, 'server', auth)       # the real server, same client, same files
    client.add_neighbors(0, f'127.0.0.1:{server.port}')
    client.send(_message(1, 0))
    assert server.receive(timeout=10).sender == 1


def test_the_server_sends_client_ks_token_only_to_client_k(parties, creds):
    server = parties(creds, 'server', 'token')
    impostor = parties(creds, 'client_2', 'token')
    server.add_neighbors(1, f'127.0.0.1:{impostor.port}')   # where client 1 was expected
    server.send(_message(0, 1))                             # warns, not delivered
    assert impostor.server_funcs.refused == 0 and not impostor.server_funcs.msg_queue


def test_certificates_carry_their_role():
    import tempfile

    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID
    with tempfile.TemporaryDirectory() as parent:
        folder = make_credentials(os.path.join(parent, 'c'), [1, 2], hosts=('10.0.0.5', 'srv'))

        def names(party):
            with open(os.path.join(folder, f'{party}.pem'), 'rb') as handle:
                cert = x509.load_pem_x509_certificate(handle.read())
            alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
            assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
            return {str(n.value) for n in alt}
        assert names('server') == {'fsplug-server', '10.0.0.5', 'srv'}
        assert names('client_1') == {'fsplug-client-1'}
        assert names('client_2') == {'fsplug-client-2'}


def test_the_receive_limit_follows_the_model():
    import torch

    from fs_plugins.fs.wire import encode_tensors, encoded_size
    shared = {'a.lora_A': torch.randn(64, 4096), 'a.lora_B': torch.randn(4096, 64)}
    limit = received_message_bound(tensor_bytes(shared), 2047 * 2 ** 20)
    assert limit == 3 * tensor_bytes(shared) * 4 // 3 + 16 * 2 ** 20
    # an update with an extra payload as large as its shared tensors (SCAFFOLD) fits
    update = {**shared, **{f'extra.{k}': v for k, v in shared.items()}}
    assert encoded_size(encode_tensors(update, distributed=True)) < limit
    assert received_message_bound(10 * 2 ** 30, 2047 * 2 ** 20) == 2047 * 2 ** 20
