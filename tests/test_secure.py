"""Credentials for FS distributed mode without FS: generated certificates and tokens, the
config checks of `fsplug.distribute`, and the receipt check (`refusal`)."""
import os
import stat

import pytest
import yaml

from fs_plugins.commands.credentials import make_credentials, party_distribute, party_files
from fs_plugins.core.errors import ConfigError
from fs_plugins.fs.secure import Credentials, raise_grpc_limits, read_credentials, refusal
from fs_plugins.run.config import Cfg
from fs_plugins.schema.options import defaults_of
from fs_plugins.schema.plugin import DistributeOptions

cryptography = pytest.importorskip('cryptography')
TOKEN = 'a' * 43


@pytest.fixture(scope='module')
def creds_dir(tmp_path_factory):
    return make_credentials(str(tmp_path_factory.mktemp('creds')), [1, 2])


def _cfg(role, **distribute):
    options = defaults_of(DistributeOptions)
    options.update(distribute)
    return Cfg.wrap({'fsplug': {'distribute': options}, 'distribute': {'role': role}})


def test_generated_certificates_name_the_party_and_chain_to_the_ca(creds_dir):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    with open(os.path.join(creds_dir, 'ca.pem'), 'rb') as handle:
        ca = x509.load_pem_x509_certificate(handle.read())
    for name in ('server', 'client_1', 'client_2'):
        with open(os.path.join(creds_dir, name + '.pem'), 'rb') as handle:
            cert = x509.load_pem_x509_certificate(handle.read())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        if name == 'server':   # the hosts, and a name no client's certificate carries
            assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ['127.0.0.1']
            assert sans.get_values_for_type(x509.DNSName) == ['fsplug-server', 'localhost']
        else:
            assert sans.get_values_for_type(x509.DNSName) == [f'fsplug-client-{name[-1]}']
            assert not sans.get_values_for_type(x509.IPAddress)
    for name in ('ca.key', 'server.key', 'client_1.key', 'client_1.token', 'client_tokens.yaml'):
        assert stat.S_IMODE(os.stat(os.path.join(creds_dir, name)).st_mode) == 0o600, name
    with open(os.path.join(creds_dir, 'client_tokens.yaml')) as handle:
        tokens = yaml.safe_load(handle)
    assert set(tokens) == {1, 2} and tokens[1] != tokens[2]
    with open(os.path.join(creds_dir, 'client_2.token')) as handle:
        assert handle.read() == tokens[2]


@pytest.mark.parametrize('auth', ['token', 'certificate'])
@pytest.mark.parametrize('name', ['server', 'client_1'])
def test_party_credentials_load(creds_dir, auth, name):
    layer = party_distribute(creds_dir, name, auth)
    assert sorted(os.path.basename(v) for k, v in layer.items() if k != 'auth') == \
        sorted(party_files(name, auth))
    credentials = read_credentials(_cfg('server' if name == 'server' else 'client', **layer))
    assert credentials.auth == auth and credentials.tls and all(credentials.tls)
    if auth == 'token' and name == 'server':
        assert set(credentials.client_tokens) == {1, 2}
    if auth == 'token' and name != 'server':
        assert len(credentials.own_token) >= 32


def test_no_security_is_plaintext():
    credentials = read_credentials(_cfg('server'))
    assert credentials.tls is None and credentials.auth == 'none'
    assert credentials.describe() == 'plaintext'


@pytest.mark.parametrize('role, distribute, expected', [
    ('server', {'tls_cert': 'x.pem'}, ['fsplug.distribute.tls_ca: needed with tls_cert',
                                       'fsplug.distribute.tls_key: needed with tls_cert']),
    ('server', {'auth': 'token'}, ['fsplug.distribute.auth: token needs TLS']),
    ('client', {'auth': 'certificate'}, ['fsplug.distribute.auth: certificate needs TLS']),
])
def test_incomplete_security_is_named(tmp_path, role, distribute, expected):
    with pytest.raises(ConfigError) as error:
        read_credentials(_cfg(role, **distribute))
    for line in expected:
        assert any(p.startswith(line) for p in error.value.problems), error.value.problems


def test_missing_files_and_bad_tokens_are_named(creds_dir, tmp_path):
    tls = party_distribute(creds_dir, 'server', 'certificate')
    missing = dict(tls, tls_key=str(tmp_path / 'nowhere.key'))
    with pytest.raises(ConfigError, match=r"tls_key: cannot read '.*nowhere\.key'"):
        read_credentials(_cfg('server', **missing))
    with pytest.raises(ConfigError, match='client_tokens: the server needs'):
        read_credentials(_cfg('server', **dict(tls, auth='token')))
    with pytest.raises(ConfigError, match='token_file: a client needs'):
        read_credentials(_cfg('client', **dict(tls, auth='token')))
    short = tmp_path / 'short.token'
    short.write_text('abc')
    with pytest.raises(ConfigError, match=r'token_file .*short\.token.*3 characters'):
        read_credentials(_cfg('client', **dict(tls, auth='token', token_file=str(short))))
    bad = tmp_path / 'tokens.yaml'
    bad.write_text(f'1: {TOKEN}\nclient_2: {TOKEN}\n')
    with pytest.raises(ConfigError, match="entry 'client_2' must be a client id"):
        read_credentials(_cfg('server', **dict(tls, auth='token', client_tokens=str(bad))))


SERVER_TOKENS = Credentials('server', 'token', client_tokens={1: 'one' * 6, 2: 'two' * 6})
CLIENT_1 = Credentials('client', 'token', own_token='one' * 6)
SERVER_CERTS = Credentials('server', 'certificate')
CLIENT_CERTS = Credentials('client', 'certificate')


@pytest.mark.parametrize('credentials, sender, token, common_name, reason', [
    (SERVER_TOKENS, 1, 'one' * 6, '', None),
    (SERVER_TOKENS, 2, 'one' * 6, '', "the token is not client 2's"),
    (SERVER_TOKENS, 2, '', '', 'no token was sent'),
    (SERVER_TOKENS, 3, 'one' * 6, '', 'has no token for client 3'),
    (SERVER_TOKENS, -1, 'one' * 6, '', 'sender id -1'),
    (SERVER_TOKENS, None, 'one' * 6, '', 'no sender id'),
    (CLIENT_1, 0, 'one' * 6, '', None),
    (CLIENT_1, 0, 'two' * 6, '', "the token is not the server's"),
    (CLIENT_1, 2, 'one' * 6, '', 'accepts messages from the server only'),
    (SERVER_CERTS, 2, '', 'client_2', None),
    (SERVER_CERTS, 2, '', 'client_1', "common name is 'client_1', not 'client_2'"),
    (CLIENT_CERTS, 0, '', 'server', None),
    (CLIENT_CERTS, 0, '', 'client_1', "common name is 'client_1', not 'server'"),
    (Credentials('server'), -1, '', '', None),   # auth none: FS's own joining by -1
])
def test_refusal(credentials, sender, token, common_name, reason):
    found = refusal(credentials, sender, token, common_name)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found, found


def test_grpc_limits_are_raised_to_max_message_mb_only_where_lower():
    cfg = _cfg('server', max_message_mb=64)
    cfg.distribute.update({'grpc_max_send_message_length': 2 ** 20,
                           'grpc_max_receive_message_length': 2 ** 30})
    raise_grpc_limits(cfg)
    assert cfg.distribute.grpc_max_send_message_length == 64 * 2 ** 20
    assert cfg.distribute.grpc_max_receive_message_length == 2 ** 30
    partial = Cfg.wrap({'fsplug': {'distribute': {'max_message_mb': 64}}})
    raise_grpc_limits(partial)   # a client's partial config node has no distribute limits
    assert 'distribute' not in partial
