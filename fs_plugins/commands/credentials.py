"""`fs-plugins credentials`: a CA, one certificate and key per party, and client tokens for
FS distributed mode with `fsplug.distribute.tls_*` and `auth` (fs_plugins.fs.secure).

Every file is written owner-only (0600) into an owner-only folder (0700), created without
following a symbolic link; an existing folder or file that others can read, a symbolic link,
or one of another user is refused naming it, never reused or followed.

Files in the output folder:
- ca.pem: every party's `tls_ca`; ca.key signs more certificates and stays with whoever
  runs the federation;
- server.pem / server.key and client_<k>.pem / client_<k>.key: each party's `tls_cert` /
  `tls_key`; common name 'server' or 'client_<k>' (what `auth: certificate` checks). Roles are
  told apart by a subject alternative name only that party's certificate carries
  (`party_host_name`: 'fsplug-server', 'fsplug-client-<k>'), which the others dial it as, so a
  client's certificate cannot pass as the server's. The server's also names the `hosts` given;
  no client's does. Every party both listens and dials (FS's server sends to the clients' ports),
  so every certificate has both extended key usages, serverAuth and clientAuth (TLS enforces
  them per direction);
- client_tokens.yaml: the server's `client_tokens`; client_<k>.token: client k's `token_file`.
What each party needs on disk is `party_files` of its name.
"""
from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import secrets
import stat

from fs_plugins.fs.secure import SERVER_ID, party_host_name

CA_NAME = 'fs-plugins federation CA'


class CredentialsError(RuntimeError):
    """Credentials that cannot be written safely (or without 'cryptography'): names the path."""


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _alt_names(hosts):
    from cryptography import x509
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue_certificate(common_name: str, hosts, ca_key=None, ca_cert=None, days: int = 365):
    """(key, certificate): signed by (ca_key, ca_cert), or a self-signed CA when they are None;
    `hosts`: its subject alternative names."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    is_ca = ca_key is None
    builder = (x509.CertificateBuilder()
               .subject_name(_name(common_name))
               .issuer_name(_name(common_name) if is_ca else ca_cert.subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if not is_ca:
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (builder.add_extension(_alt_names(hosts), critical=False)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    return key, builder.sign(key if is_ca else ca_key, hashes.SHA256())


def _refuse_unsafe(path: str, st: os.stat_result, kind: str, is_kind) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise CredentialsError(f'{path} is a symbolic link: refused (credentials are never '
                               f'written through a link)')
    if not is_kind(st.st_mode):
        raise CredentialsError(f'{path} exists and is not a {kind}')
    if st.st_uid != os.getuid():
        raise CredentialsError(f'{path} belongs to another user: refused')
    if st.st_mode & 0o077:
        raise CredentialsError(f'{path} has mode {stat.S_IMODE(st.st_mode):04o}: others may have '
                               f'read it; refused (remove it, or choose a new folder)')


def private_folder(path: str) -> str:
    """`path` as an owner-only folder: created 0700, or an existing one checked."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    _refuse_unsafe(path, os.lstat(path), 'folder', stat.S_ISDIR)
    return path


def _write(path: str, data: bytes) -> None:
    """Writes `path` 0600, never through a link: an existing file is replaced only when it is
    a plain owner-only file of this user (inside a folder `private_folder` checked)."""
    try:
        _refuse_unsafe(path, os.lstat(path), 'file', stat.S_ISREG)
        os.remove(path)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, 'O_CLOEXEC', 0)
    with os.fdopen(os.open(path, flags, 0o600), 'wb') as handle:
        handle.write(data)


def _pem(key=None, cert=None) -> bytes:
    from cryptography.hazmat.primitives import serialization
    if cert is not None:
        return cert.public_bytes(serialization.Encoding.PEM)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_credentials(out_dir: str, client_ids, hosts=('127.0.0.1', 'localhost'),
                     days: int = 365, keep_ca_key: bool = True) -> str:
    """Writes the CA, every party's certificate and key, and the client tokens to `out_dir`.
    keep_ca_key=False: ca.key is not written (nothing can sign more certificates later)."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise CredentialsError("fs-plugins credentials needs the 'cryptography' package "
                               '(pip install cryptography)') from None
    import yaml
    private_folder(out_dir)
    ca_key, ca_cert = issue_certificate(CA_NAME, hosts, days=days)
    _write(os.path.join(out_dir, 'ca.pem'), _pem(cert=ca_cert))
    if keep_ca_key:
        _write(os.path.join(out_dir, 'ca.key'), _pem(key=ca_key))
    for name, alt_names in _party_alt_names(client_ids, hosts):
        key, cert = issue_certificate(name, alt_names, ca_key, ca_cert, days)
        _write(os.path.join(out_dir, name + '.pem'), _pem(cert=cert))
        _write(os.path.join(out_dir, name + '.key'), _pem(key=key))
    tokens = {int(k): secrets.token_urlsafe(32) for k in client_ids}
    _write(os.path.join(out_dir, 'client_tokens.yaml'), yaml.safe_dump(tokens).encode())
    for k, token in tokens.items():
        _write(os.path.join(out_dir, f'client_{k}.token'), token.encode())
    return out_dir


def _party_alt_names(client_ids, hosts):
    """(common name, subject alternative names) of each party's certificate."""
    yield 'server', [party_host_name(SERVER_ID), *hosts]
    for k in client_ids:
        yield f'client_{k}', [party_host_name(int(k))]


def party_files(name: str, auth: str) -> list[str]:
    """The files of a credentials folder party `name` ('server', 'client_<k>') needs."""
    files = ['ca.pem', f'{name}.pem', f'{name}.key']
    if auth == 'token':
        files.append('client_tokens.yaml' if name == 'server' else f'{name}.token')
    return files


def party_distribute(folder: str, name: str, auth: str) -> dict:
    """`fsplug.distribute` of party `name` with the credentials in `folder`."""
    folder = os.path.abspath(folder)
    layer = {'tls_ca': os.path.join(folder, 'ca.pem'),
             'tls_cert': os.path.join(folder, f'{name}.pem'),
             'tls_key': os.path.join(folder, f'{name}.key'), 'auth': auth}
    if auth == 'token':
        key, file = (('client_tokens', 'client_tokens.yaml') if name == 'server'
                     else ('token_file', f'{name}.token'))
        layer[key] = os.path.join(folder, file)
    return layer
