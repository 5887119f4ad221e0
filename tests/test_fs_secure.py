"""TLS and client authentication on FS's gRPC (fs_plugins.fs.secure), with certificates
generated in the test, on 127.0.0.1. Skipped, with the reason, where FederatedScope (and its
gRPC) is not installed."""
import os

import pytest

from fs_plugins.commands.credentials import make_credentials, party_distribute
from fs_plugins.fs.ports import free_ports
from fs_plugins.fs.secure import CredentialsRefused, party_comm_manager

pytestmark = pytest.mark.fs   # the fs tier: skipped, with the reason, without FederatedScope


@pytest.fixture(scope='module')
def creds(tmp_path_factory):
    return make_credentials(str(tmp_path_factory.mktemp('creds')), [1, 2])


@pytest.fixture(scope='module')
def other_ca(tmp_path_factory):
    return make_credentials(str(tmp_path_factory.mktemp('other')), [1, 2])


def _read(folder, name):
    with open(os.path.join(folder, name), 'rb') as handle:
        return handle.read()


class Parties:
    """Plugin comm managers on 127.0.0.1 with the credentials of a folder, stopped at the end
    of the test."""

    def __init__(self):
        self.managers = []

    def make(self, folder, name, auth, server=None, token_of=None):
        """Party `name` ('server', 'client_<k>'); `token_of`: another client's token instead."""
        distribute = dict(party_distribute(folder, name, auth), connect_timeout_s=3.0)
        if token_of:
            distribute['token_file'] = os.path.join(folder, f'{token_of}.token')
        manager = party_comm_manager('server' if name == 'server' else 'client', distribute)
        self.managers.append(manager)
        if server is not None:
            manager.add_neighbors(0, f'127.0.0.1:{server.port}')
        return manager

    def close(self):
        for manager in self.managers:
            manager.grpc_server.stop(0)


@pytest.fixture
def parties():
    made = Parties()
    yield made
    made.close()


def _message(sender, receiver, msg_type='join_in', content='x'):
    from federatedscope.core.message import Message
    return Message(msg_type=msg_type, sender=sender, receiver=[receiver], state=0, timestamp=0,
                   content=content)


def _queued(manager) -> int:
    return len(manager.server_funcs.msg_queue)


@pytest.mark.parametrize('auth', ['token', 'certificate'])
def test_authenticated_parties_exchange_messages(parties, creds, auth):
    server = parties.make(creds, 'server', auth)
    client = parties.make(creds, 'client_1', auth, server)
    client.send(_message(1, 0, content={'host': '127.0.0.1', 'port': client.port}))
    joined = server.receive()
    assert (joined.msg_type, joined.sender) == ('join_in', 1)
    server.add_neighbors(1, joined.content)
    server.send(_message(0, 1, msg_type='model_para'))
    assert client.receive().msg_type == 'model_para'
    assert server.sent_messages == client.sent_messages == 1
    assert server.server_funcs.refused == client.server_funcs.refused == 0


@pytest.mark.parametrize('auth', ['token', 'certificate'])
def test_a_client_cannot_send_under_another_id(parties, creds, auth):
    server = parties.make(creds, 'server', auth)
    client_1 = parties.make(creds, 'client_1', auth, server)
    expected = "token is not client 2's" if auth == 'token' else \
        "common name is 'client_1', not 'client_2'"
    with pytest.raises(CredentialsRefused, match=expected):
        client_1.send(_message(2, 0))
    assert _queued(server) == 0 and server.server_funcs.refused == 1


def test_a_wrong_token_is_refused_before_joining(parties, creds):
    server = parties.make(creds, 'server', 'token')
    # client 1's certificate (TLS passes) with client 2's token
    impostor = parties.make(creds, 'client_1', 'token', server, token_of='client_2')
    with pytest.raises(CredentialsRefused, match="token is not client 1's"):
        impostor.send(_message(1, 0))
    assert _queued(server) == 0


def test_clients_accept_only_the_server(parties, creds):
    client_1 = parties.make(creds, 'client_1', 'token')
    client_2 = parties.make(creds, 'client_2', 'token')
    client_2.add_neighbors(1, f'127.0.0.1:{client_1.port}')
    with pytest.raises(CredentialsRefused, match='accepts messages from the server only'):
        client_2.send(_message(2, 1, msg_type='model_para'))
    with pytest.raises(CredentialsRefused, match="token is not the server's"):
        client_2.send(_message(0, 1, msg_type='model_para'))   # posing as the server
    assert _queued(client_1) == 0


@pytest.mark.parametrize('auth', ['token', 'certificate'])
def test_a_certificate_from_another_ca_fails_the_handshake(parties, creds, other_ca, auth):
    server = parties.make(creds, 'server', auth)
    outsider = parties.make(other_ca, 'client_1', auth, server)
    with pytest.raises(ConnectionError, match='(?i)handshake failed'):
        outsider.send(_message(1, 0))
    assert _queued(server) == 0


@pytest.mark.parametrize('channel', ['plaintext', 'tls without a client certificate'])
def test_unauthenticated_channels_are_refused(parties, creds, channel):
    import grpc
    from federatedscope.core.proto import gRPC_comm_manager_pb2_grpc
    server = parties.make(creds, 'server', 'certificate')
    address = f'127.0.0.1:{server.port}'
    opened = grpc.insecure_channel(address) if channel == 'plaintext' else \
        grpc.secure_channel(address, grpc.ssl_channel_credentials(_read(creds, 'ca.pem')))
    stub = gRPC_comm_manager_pb2_grpc.gRPCComServeFuncStub(opened)
    with pytest.raises(grpc.RpcError) as error:
        stub.sendMessage(_message(1, 0).transform(), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    opened.close()
    assert _queued(server) == 0


def test_an_unreachable_server_fails_the_client_after_its_timeout(parties, creds):
    client = parties.make(creds, 'client_1', 'token')
    client.add_neighbors(0, f'127.0.0.1:{free_ports(1)[0]}')   # nobody listens there
    with pytest.raises(ConnectionError, match=r"cannot deliver 'join_in' to the server at"):
        client.send(_message(1, 0))
