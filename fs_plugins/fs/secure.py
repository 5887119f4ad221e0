"""FS distributed mode through the plugin's own gRPC comm manager: TLS, client authentication,
one reused channel per peer, a receive that sleeps instead of spinning (with a timeout, for the
workers' deadlines) and never raises on a malformed message, a probe of whether a peer still
listens, and failures that name the party.

FS's `gRPCCommManager` listens on an insecure port and opens a plaintext channel for every
message, so anyone who reaches a port can join as any client or send under any id. The
plugin's workers construct `PluginCommManager` instead: FS's class name is swapped in FS's
worker modules only while FS's Server/Client `__init__` runs (`plugin_comm_manager`), so FS is
not edited and no insecure port opens when TLS is configured.

Who may send (`fsplug.distribute.auth`); every FS message names its sender:
- token: client k and the server share a secret (the server's `client_tokens` file, client k's
  `token_file`), carried as gRPC metadata with every message: client k sends its own, the
  server sends client k's to client k. The server accepts a message from sender k only with
  k's token; a client accepts only messages from the server (id 0) with its own token.
- certificate: mutual TLS; the sender's certificate common name must be 'server' for id 0 and
  'client_<k>' for id k.
Every message also carries its sender id as metadata (`SENDER_METADATA`). The check runs before
the body is read (`_AuthInterceptor`): the token on the metadata alone, in the interceptor; the
certificate from the TLS auth context, before the request is pulled from the stream. A refused
call is answered UNAUTHENTICATED (a warning on the receiver, the sender fails with the reason)
and its body is never read, decompressed or parsed. An accepted one is parsed, and its message
must name the sender it was authenticated as (`_CheckedServeFunc`).

Bodies are bounded: no listener lets gRPC decompress (a compressed body is inflated by
`inflated` only after the check, to at most the receive limit), and the server's receive limit
is sized from its model (`received_message_bound`).

Identity of the receiver: with TLS a party dials the server as `party_host_name(0)` and client k
as `party_host_name(k)`, names that only that party's certificate carries
(`fs-plugins credentials`), so a token is never sent to a listener holding another party's
certificate: the TLS handshake fails first.
"""
from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import socket
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field

import yaml

from fs_plugins.core.errors import ConfigError
from fs_plugins.fs.ports import free_ports

logger = logging.getLogger(__name__)

TOKEN_METADATA = 'fsplug-token'
SENDER_METADATA = 'fsplug-sender'
SERVER_ID = 0
MIN_TOKEN_CHARS = 16
LOOPBACK = ('127.0.0.1', 'localhost', '::1')
RETRY_S = 1.0
PROBE_CONNECT_S = 3.0
UNREADABLE_MSG = 'fsplug_unreadable'   # what `receive` makes of a request FS cannot parse
# the server's receive limit: an update's shared tensors, an extra payload as large (SCAFFOLD's
# control variates) and as much again for a client whose architecture shares more, base64-encoded
RECEIVE_FACTOR = 3
RECEIVE_MARGIN = 16 * 2 ** 20   # safetensors and JSON headers, metrics, FS's envelope
# a compressed body, passed up as is (no listener lets gRPC decompress): gzip's magic number or
# zlib's header byte; an FS MessageRequest (field 1 only) starts with 0x0a
COMPRESSED_PREFIXES = (b'\x1f\x8b', b'\x78')


@dataclass
class Credentials:
    role: str                                        # 'server' or 'client'
    auth: str = 'none'                               # 'none', 'token' or 'certificate'
    tls: tuple[bytes, bytes, bytes] | None = None    # (CA, this party's certificate, its key)
    own_token: str = ''                              # a client's
    client_tokens: dict[int, str] = field(default_factory=dict)   # the server's

    def describe(self) -> str:
        return ('TLS' if self.tls else 'plaintext') + (f', auth {self.auth}'
                                                       if self.auth != 'none' else '')


def party_name(party_id: int) -> str:
    return 'the server' if party_id == SERVER_ID else f'client {party_id}'


def party_host_name(party_id: int) -> str:
    """The DNS name in party `party_id`'s certificate only, which the others dial it as."""
    return 'fsplug-server' if party_id == SERVER_ID else f'fsplug-client-{party_id}'


def tensor_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def received_message_bound(global_bytes: int, ceiling: int) -> int:
    """The server's gRPC receive limit in bytes: the largest legitimate message (a client's
    update of a global state of `global_bytes`, see RECEIVE_FACTOR) plus RECEIVE_MARGIN, at
    most `ceiling` (fsplug.distribute.max_message_mb as FS's limit)."""
    return min(RECEIVE_FACTOR * global_bytes * 4 // 3 + RECEIVE_MARGIN, int(ceiling))


def inflated(body: bytes, limit: int) -> bytes:
    """`body` decompressed when gzip/deflate-compressed (else as is), refusing more than
    `limit` bytes without inflating further."""
    if not body.startswith(COMPRESSED_PREFIXES):
        return body
    inflater = zlib.decompressobj(wbits=32 + zlib.MAX_WBITS)   # zlib or gzip header
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ValueError(f'a compressed message that does not inflate ({exc})') from None
    if len(data) > limit or inflater.unconsumed_tail:
        raise ValueError(f'the message inflates to over {limit} bytes (the receive limit)')
    return data


# ------------------------------------------------------------------ reading and checking
def raise_grpc_limits(cfg) -> None:
    """FS's gRPC message limits, raised to fsplug.distribute.max_message_mb where lower."""
    limit = int(cfg.fsplug.distribute.max_message_mb) * 2 ** 20
    for key in ('grpc_max_send_message_length', 'grpc_max_receive_message_length'):
        if key in cfg.get('distribute', {}):   # absent from a client's partial config node
            cfg.distribute[key] = max(int(cfg.distribute[key]), limit)


def read_credentials(cfg) -> Credentials:
    """The credentials `fsplug.distribute` names for this party (FS's distribute.role); every
    problem (a missing key, an unreadable file, a short token) at once, naming key and path."""
    opts, role = cfg.fsplug.distribute, str(cfg.distribute.role)
    problems: list[str] = []
    tls_keys = ('tls_ca', 'tls_cert', 'tls_key')
    given = [key for key in tls_keys if opts[key]]
    if given and len(given) < len(tls_keys):
        problems += [f'fsplug.distribute.{key}: needed with {", ".join(given)} (TLS takes the CA, '
                     f"this party's certificate and its key)" for key in tls_keys if key not in given]
    if opts.auth != 'none' and not given:
        problems.append(f'fsplug.distribute.auth: {opts.auth} needs TLS (tls_ca, tls_cert, '
                        f'tls_key); without it {opts.auth}s would travel in the clear')
    files = [_read_file(f'fsplug.distribute.{key}', opts[key], problems) for key in given]
    credentials = Credentials(role, str(opts.auth), tuple(files) if len(given) == 3 else None)
    if opts.auth == 'token':
        if role == 'server':
            credentials.client_tokens = _read_client_tokens(opts.client_tokens, problems)
        else:
            credentials.own_token = _read_own_token(opts.token_file, problems)
    if problems:
        raise ConfigError(problems)
    return credentials


def _read_file(key: str, path: str, problems: list[str]) -> bytes:
    try:
        with open(path, 'rb') as handle:
            return handle.read()
    except OSError as exc:
        problems.append(f'{key}: cannot read {path!r} ({exc.strerror or exc})')
        return b''


def _check_token(token: str, where: str, problems: list[str]) -> str:
    if len(token) < MIN_TOKEN_CHARS:
        problems.append(f'{where}: the token has {len(token)} characters; at least '
                        f'{MIN_TOKEN_CHARS} are needed (fs-plugins credentials makes 43)')
    return token


def _read_own_token(path: str, problems: list[str]) -> str:
    key = 'fsplug.distribute.token_file'
    if not path:
        problems.append(f'{key}: a client needs its token file with auth: token')
        return ''
    known = len(problems)
    text = _read_file(key, path, problems).decode('utf-8', errors='replace').strip()
    return _check_token(text, f'{key} ({path})', problems) if len(problems) == known else ''


def _read_client_tokens(path: str, problems: list[str]) -> dict[int, str]:
    key = 'fsplug.distribute.client_tokens'
    if not path:
        problems.append(f'{key}: the server needs the clients\' tokens with auth: token')
        return {}
    raw = _read_file(key, path, problems)
    try:
        entries = yaml.safe_load(raw) if raw else {}
    except yaml.YAMLError as exc:
        problems.append(f'{key}: {path!r} is not YAML ({exc})')
        return {}
    if not isinstance(entries, dict):
        problems.append(f'{key}: {path!r} must map client ids to tokens (e.g. "1: <token>")')
        return {}
    tokens = {}
    for client, token in entries.items():
        if not isinstance(client, int) or client < 1 or not isinstance(token, str):
            problems.append(f'{key}: {path!r}: entry {client!r} must be a client id >= 1 '
                            f'mapped to a token string')
            continue
        tokens[client] = _check_token(token.strip(), f'{key} ({path}), client {client}', problems)
    return tokens


# ------------------------------------------------------------------ the check on receipt
def refusal(credentials: Credentials, sender, token: str, common_name: str) -> str | None:
    """Why this party refuses a message claiming to come from `sender` (None: accepted).
    `token`: the gRPC metadata sent with it; `common_name`: of the peer's TLS certificate."""
    if credentials.auth == 'none':
        return None
    if not isinstance(sender, int):
        return f'the message has no sender id ({sender!r})'
    if credentials.role == 'client' and sender != SERVER_ID:
        return f'it claims {party_name(sender)}; a client accepts messages from the server only'
    if credentials.role == 'server' and sender < 1:
        return (f'sender id {sender}: with fsplug.distribute.auth a client sends under its own '
                f'id (distribute.data_idx >= 1)')
    if credentials.auth == 'token':
        expected = (credentials.own_token if credentials.role == 'client'
                    else credentials.client_tokens.get(sender))
        if expected is None:
            return f'fsplug.distribute.client_tokens has no token for client {sender}'
        if not token:
            return 'no token was sent'
        if not hmac.compare_digest(token.encode(), expected.encode()):
            return f"the token is not {party_name(sender)}'s"
    if credentials.auth == 'certificate':
        expected_name = 'server' if sender == SERVER_ID else f'client_{sender}'
        if common_name != expected_name:
            return (f"it claims {party_name(sender)} but the certificate's common name is "
                    f'{common_name!r}, not {expected_name!r}')
    return None


# ------------------------------------------------------------------ gRPC
# FS and grpc are imported on first use: this module's reading and checking also serve
# `fs-plugins launch` and the embedded runner, where neither need be installed.
def _grpc_parts():
    import grpc  # lazy: only FS's distributed mode needs grpc (the `fs` extra)
    from federatedscope.core.communication import gRPCCommManager  # lazy: FS loads on first use
    from federatedscope.core.gRPC_server import gRPCComServeFunc  # lazy: FS loads on first use
    from federatedscope.core.proto import gRPC_comm_manager_pb2_grpc  # lazy: FS loads on first use
    return grpc, gRPCCommManager, gRPCComServeFunc, gRPC_comm_manager_pb2_grpc


def _sender_of(request):
    from federatedscope.core.message import Message  # lazy: FS loads on first use
    try:
        return int(Message()._parse_msg(request.msg['sender']))
    except (TypeError, ValueError, AttributeError):
        return None


def _claimed_sender(metadata_or_context):
    """The sender id in a call's metadata (None: absent or not an integer)."""
    metadata = (metadata_or_context.invocation_metadata()
                if hasattr(metadata_or_context, 'invocation_metadata') else metadata_or_context)
    try:
        return int(_metadata_lookup(metadata, SENDER_METADATA))
    except ValueError:
        return None


def _metadata_lookup(metadata, key: str) -> str:
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else value.decode('utf-8', errors='replace')
    return ''


def _common_name(context) -> str:
    names = (context.auth_context() or {}).get('x509_common_name') or [b'']
    return names[0].decode('utf-8', errors='replace')


def _is_handshake_failure(error) -> bool:
    details = str(error.details()).lower()
    return 'handshake' in details or 'ssl' in details or _is_wrong_identity(error)


def _is_wrong_identity(error) -> bool:
    """The listener's certificate is valid but not the dialled party's (`party_host_name`)."""
    return 'hostname verification' in str(error.details()).lower()


class CredentialsRefused(RuntimeError):
    """Another party refused this party's message: the reason is in the text."""


class _CheckedServeFunc:
    """FS's receiving servicer; a message is queued only when its sender's credentials
    match (`refusal`). `receive` sleeps until one arrives: FS's spins, a whole CPU core
    per waiting process, which the training processes of a one-machine federation need.
    Mixed into FS's gRPCComServeFunc by `comm_classes`, which sets `_grpc`."""
    _grpc = None   # the grpc module

    def __init__(self, credentials: Credentials):
        super().__init__()
        self.credentials = credentials
        self.refused = 0
        self._arrived = threading.Condition()

    def refuse(self, context, sender, reason: str) -> None:
        """Aborts the call UNAUTHENTICATED (raises), with a warning naming the peer."""
        self.refused += 1
        logger.warning(f'fsplug: refused a message claiming to come from '
                       f'{party_name(sender) if isinstance(sender, int) else "?"} '
                       f'(peer {context.peer()}): {reason}')
        context.abort(self._grpc.StatusCode.UNAUTHENTICATED, reason)

    def receive(self, timeout: float | None = None):
        """The next request; None when `timeout` seconds pass without one."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: self.msg_queue, timeout):
                return None
            return self.msg_queue.popleft()

    def sendMessage(self, request, context):
        # `_AuthInterceptor` authenticated the sender named in the metadata; the message
        # must be from that sender, or one client's token could send under another's id
        sender, claimed = _sender_of(request), _claimed_sender(context)
        if self.credentials.auth != 'none' and sender != claimed:
            self.refuse(context, claimed, f'the message names sender {sender!r}, but the call '
                                          f'was authenticated as {party_name(claimed)}')
        with self._arrived:
            response = super().sendMessage(request, context)
            self._arrived.notify()
        return response


class _AuthInterceptor:
    """Who sends is checked before the body is read: every call is served as a stream whose
    one request is pulled only once the sender is accepted, so a refused call's body is never
    read, decompressed or parsed (FS's request deserializer does not run). The token is checked
    on the metadata here; the certificate (the TLS auth context is not in the metadata) first
    thing in the call. Mixed into grpc.ServerInterceptor by `comm_classes`, which sets `_grpc`."""
    _grpc = None

    def __init__(self, credentials: Credentials, servicer, receive_limit: int):
        self.credentials = credentials
        self.servicer = servicer                # a CheckedServeFunc: counts and logs refusals
        self.receive_limit = receive_limit

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        claimed = _claimed_sender(details.invocation_metadata)
        reason = None
        if self.credentials.auth == 'token':
            token = _metadata_lookup(details.invocation_metadata, TOKEN_METADATA)
            reason = refusal(self.credentials, claimed, token, '')
        if reason:
            return self._grpc.stream_unary_rpc_method_handler(
                functools.partial(self._refused_call, claimed, reason))
        return self._grpc.stream_unary_rpc_method_handler(
            functools.partial(self._checked_call, handler, claimed),
            response_serializer=handler.response_serializer)

    def _refused_call(self, claimed, reason: str, request_stream, context):
        self.servicer.refuse(context, claimed, reason)

    def _checked_call(self, handler, claimed, request_stream, context):
        if self.credentials.auth == 'certificate':
            reason = refusal(self.credentials, claimed, '', _common_name(context))
            if reason:
                self.servicer.refuse(context, claimed, reason)
        body = next(request_stream, None)
        if body is None:
            context.abort(self._grpc.StatusCode.INVALID_ARGUMENT, 'no message was sent')
        try:
            body = inflated(body, self.receive_limit)
        except ValueError as exc:
            context.abort(self._grpc.StatusCode.INVALID_ARGUMENT, f'refused: {exc}')
        return handler.unary_unary(handler.request_deserializer(body), context)


class _PluginCommManager:
    """FS's gRPCCommManager with TLS and authentication (`Credentials`), one channel per
    peer kept open, byte counts, and errors that name the party: a client that cannot
    reach the server retries for connect_timeout_s, then fails; a refused message fails
    its sender; a server that cannot reach a client warns and goes on (as FS: the client
    may rejoin). Mixed into FS's gRPCCommManager by `comm_classes`, which sets `_grpc`,
    `_pb2_grpc` (FS's generated gRPC module) and `_serve_func` (the checked servicer)."""
    _grpc = _pb2_grpc = _serve_func = _interceptor = None

    def __init__(self, credentials: Credentials, connect_timeout_s: float,
                 receive_limit: int | None = None,
                 host='0.0.0.0', port='50050', client_num=2, cfg=None):
        self.credentials = credentials
        self.connect_timeout_s = connect_timeout_s
        self.receive_limit = int(receive_limit or cfg.grpc_max_receive_message_length)
        self._channels: dict = {}
        self._channel_options = [
            ('grpc.max_send_message_length', cfg.grpc_max_send_message_length),
            ('grpc.max_receive_message_length', cfg.grpc_max_receive_message_length),
            ('grpc.enable_http_proxy', 0)]
        self.sent_messages = self.sent_bytes = 0
        super().__init__(host=host, port=port, client_num=client_num, cfg=cfg)
        if credentials.auth == 'none' and str(host) not in LOOPBACK:
            logger.warning(f'fsplug: {host}:{port} listens without client authentication '
                           f'({credentials.describe()}): any process that reaches it can '
                           f'send under any id (set fsplug.distribute.auth; see '
                           f'docs/distributed.md)')

    # ---------------------------------------------------------------- receiving
    def serve(self, max_workers, host, port, options):
        self.server_funcs = self._serve_func(self.credentials)
        options = [option for option in options
                   if option[0] != 'grpc.max_receive_message_length']
        options += [('grpc.max_receive_message_length', self.receive_limit),
                    ('grpc.per_message_decompression', 0)]   # `inflated`, after the check
        server = self._grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers), compression=self.comp_method,
            options=options,
            interceptors=[self._interceptor(self.credentials, self.server_funcs,
                                            self.receive_limit)])
        self._pb2_grpc.add_gRPCComServeFuncServicer_to_server(self.server_funcs, server)
        self._add_port(server, f'{host}:{port}')
        server.start()
        return server

    def _add_port(self, server, address: str) -> None:
        """TLS when configured (client certificates required with auth: certificate)."""
        if self.credentials.tls:
            ca, cert, key = self.credentials.tls
            server.add_secure_port(address, self._grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca,
                require_client_auth=self.credentials.auth == 'certificate'))
        else:
            server.add_insecure_port(address)

    def receive(self, timeout: float | None = None):
        """The next message; None when `timeout` seconds pass without one. A request FS
        cannot parse comes as an UNREADABLE_MSG message naming the reason (from its sender
        where that can be read), for the receiver to reject rather than crash on."""
        request = self.server_funcs.receive(timeout)
        if request is None:
            return None
        from federatedscope.core.message import Message  # lazy: FS loads on first use
        message = Message()
        try:
            message.parse(request.msg)
        except Exception as exc:   # any malformed field: one sender's fault, not the receiver's
            return Message(msg_type=UNREADABLE_MSG, sender=_sender_of(request), receiver=[],
                           state=-1, timestamp=0,
                           content=f'unreadable message ({type(exc).__name__}: {exc})'[:300])
        return message

    def reachable(self, peer_id, timeout: float = PROBE_CONNECT_S) -> bool:
        """Whether `peer_id`'s port accepts a TCP connection now (a process listens there):
        a bare connect, without gRPC's reconnection back-off, which could hide a peer that
        is back."""
        host, _, port = str(self.neighbors[peer_id]).rpartition(':')
        try:
            with socket.create_connection((host.strip('[]'), int(port)), timeout=timeout):
                return True
        except (OSError, ValueError):
            return False

    # ---------------------------------------------------------------- sending
    def send(self, message):
        receivers = message.receiver
        if receivers is None:
            receivers = list(self.neighbors)
        elif not isinstance(receivers, list):
            receivers = [receivers]
        request = message.transform(to_list=True)
        for receiver in receivers:
            if receiver in self.neighbors:
                self._deliver(receiver, request, message.msg_type, message.sender)

    def _deliver(self, receiver, request, msg_type: str, sender) -> None:
        address = self.neighbors[receiver]
        metadata = self._metadata(receiver, sender)
        retry_until = time.monotonic() + (self.connect_timeout_s
                                          if self.credentials.role == 'client' else 0)
        while True:
            try:
                self._stub(address, receiver).sendMessage(request, metadata=metadata)
                self.sent_messages += 1
                self.sent_bytes += request.ByteSize()
                return
            except self._grpc.RpcError as error:
                self._close_channel(address)
                what = f'{party_name(receiver)} at {address}'
                if _is_wrong_identity(error):
                    what += (f" (its certificate is not {party_name(receiver)}'s: it lacks the "
                             f'name {party_host_name(receiver)}; nothing was sent. Certificates '
                             f'made before role names: make them again with fs-plugins '
                             f'credentials)')
                if not self._retry_after(error, what, msg_type, retry_until):
                    return
                time.sleep(RETRY_S)

    def _retry_after(self, error, what: str, msg_type: str, retry_until: float) -> bool:
        """After a failed delivery to `what`: True to try again (unreachable, within the
        client's connect timeout); otherwise raises on a client (CredentialsRefused when the
        receiver refused) and warns on the server, returning False."""
        status = self._grpc.StatusCode
        if error.code() in (status.UNAUTHENTICATED, status.PERMISSION_DENIED):
            raise CredentialsRefused(f'fsplug: {what} refused the {msg_type!r} '
                                     f'message: {error.details()}') from None
        if error.code() == status.UNAVAILABLE and not _is_handshake_failure(error) and \
                time.monotonic() < retry_until:
            return True
        reason = f'{error.code().name}: {error.details()}'
        if self.credentials.role == 'client':
            raise ConnectionError(f'fsplug: cannot deliver {msg_type!r} to {what} '
                                  f'({reason}); check the address and, with TLS, '
                                  f'fsplug.distribute.tls_*') from None
        logger.warning(f'fsplug: {msg_type!r} not delivered to {what} ({reason})')
        return False

    def _metadata(self, receiver, sender) -> tuple:
        metadata = ((SENDER_METADATA, str(sender)),)
        if self.credentials.auth != 'token':
            return metadata
        token = (self.credentials.own_token if self.credentials.role == 'client'
                 else self.credentials.client_tokens.get(receiver, ''))
        return metadata + ((TOKEN_METADATA, token),)

    def _stub(self, address: str, receiver):
        if address not in self._channels:
            channel = self._open_channel(address, receiver)
            self._channels[address] = (self._pb2_grpc.gRPCComServeFuncStub(channel), channel)
        return self._channels[address][0]

    def _open_channel(self, address: str, receiver):
        if self.credentials.tls:
            ca, cert, key = self.credentials.tls
            # the handshake fails unless the listener's certificate is `receiver`'s own, so
            # no token goes to another party listening at its address
            options = self._channel_options + [
                ('grpc.ssl_target_name_override', party_host_name(receiver))]
            return self._grpc.secure_channel(
                address, self._grpc.ssl_channel_credentials(ca, key, cert),
                options=options, compression=self.comp_method)
        return self._grpc.insecure_channel(address, options=self._channel_options,
                                           compression=self.comp_method)

    def _close_channel(self, address: str) -> None:
        stub_and_channel = self._channels.pop(address, None)
        if stub_and_channel:
            stub_and_channel[1].close()

    def summary(self) -> str:
        return (f'sent {self.sent_messages} messages, {self.sent_bytes} bytes '
                f'({self.credentials.describe()}); refused {self.server_funcs.refused}')


def _on_fs_class(mixin, fs_class, name: str, **attributes):
    """Class `name`: `mixin`'s methods over FS's `fs_class`, with `attributes` set on it."""
    return type(name, (mixin, fs_class), {'__module__': __name__, '__qualname__': name,
                                          '__doc__': mixin.__doc__, **attributes})


@functools.lru_cache(maxsize=1)
def comm_classes():
    """(CheckedServeFunc, PluginCommManager), built on FS's classes (imported on first use)."""
    grpc, fs_comm_manager, fs_serve_func, pb2_grpc = _grpc_parts()
    serve_func = _on_fs_class(_CheckedServeFunc, fs_serve_func, 'CheckedServeFunc', _grpc=grpc)
    interceptor = _on_fs_class(_AuthInterceptor, grpc.ServerInterceptor, 'AuthInterceptor',
                               _grpc=grpc)
    comm_manager = _on_fs_class(_PluginCommManager, fs_comm_manager, 'PluginCommManager',
                                _grpc=grpc, _pb2_grpc=pb2_grpc, _serve_func=serve_func,
                                _interceptor=interceptor)
    return serve_func, comm_manager


def comm_manager_factory(cfg, receive_limit: int | None = None):
    """What FS's workers call instead of gRPCCommManager(host=, port=, client_num=, cfg=);
    `receive_limit`: bytes its port accepts in one message (None: FS's
    distribute.grpc_max_receive_message_length)."""
    return functools.partial(comm_classes()[1], read_credentials(cfg),
                             float(cfg.fsplug.distribute.connect_timeout_s), receive_limit)


def party_comm_manager(role: str, distribute: dict | None = None, host: str = '127.0.0.1',
                       port: int | None = None, receive_limit: int | None = None):
    """The plugin's comm manager of one party outside an FS worker, on FS's defaults with
    `distribute` as its fsplug.distribute and gRPC limits raised as a run raises them (for
    tools and tests that talk to a federation directly); listening on a free port unless
    `port` is given."""
    from federatedscope.core.configs.config import global_cfg  # lazy: FS loads on first use
    cfg = global_cfg.clone()
    cfg.federate.mode = 'distributed'
    cfg.distribute.role = role
    cfg.fsplug.distribute.update(distribute or {})
    raise_grpc_limits(cfg)
    factory = comm_manager_factory(cfg, receive_limit)
    return factory(host=host, port=port or free_ports(1, host)[0], client_num=1,
                   cfg=cfg.distribute)


@contextlib.contextmanager
def plugin_comm_manager(cfg, receive_limit: int | None = None):
    """While FS's Server/Client __init__ runs, its gRPCCommManager is the plugin's."""
    import federatedscope.core.workers.client as fs_client  # lazy: FS loads on first use
    import federatedscope.core.workers.server as fs_server  # lazy: FS loads on first use
    factory = comm_manager_factory(cfg, receive_limit)
    saved = fs_server.gRPCCommManager, fs_client.gRPCCommManager
    fs_server.gRPCCommManager = fs_client.gRPCCommManager = factory
    try:
        yield
    finally:
        fs_server.gRPCCommManager, fs_client.gRPCCommManager = saved
