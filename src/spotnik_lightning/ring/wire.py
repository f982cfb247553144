"""Wire format of ring connections: handshake, frame header, heartbeat datagrams.

A connection is unidirectional for payload (the connector sends frames, the acceptor reads
them); the acceptor only ever writes during the handshake. Every connection starts with an
HMAC challenge-response proving both ends know the job secret, and checks protocol version and
run id. After that, frames are ``HEADER || payload``; a header that is malformed, of an unknown
kind or announces more bytes than allowed closes that connection with a logged reason.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from spotnik_lightning.api import ConfigError, ProtocolError

PROTOCOL_VERSION = 1
MAGIC = b"SPTK"
MAX_NAME = 255
MAX_CTRL_BYTES = 1 << 20

# kind, epoch, collective seq, frame index, payload length
HEADER = struct.Struct("!4sB3xIQI4xQ")
KIND_DATA = 1
KIND_CTRL = 2
KINDS = (KIND_DATA, KIND_CTRL)

# challenge from acceptor: magic, version, nonce
_CHALLENGE = struct.Struct("!4sH16s")
# response from connector: magic, version, nonce, mac, then 3 length-prefixed strings
_RESPONSE = struct.Struct("!4sH16s32sBBB")
_VERDICT = struct.Struct("!B32s")

HEARTBEAT = struct.Struct("!4sI16s")  # magic, epoch, mac[:16]; sender id follows


def load_secret(secret: bytes | str | None = None) -> bytes:
    """The job secret: ``secret`` if given, else ``$SPOTNIK_SECRET``, else a machine-local secret
    kept in ``~/.cache/spotnik/secret`` (created 0600 on first use: every worker on this machine
    shares it, which is the one-machine default). Raises ConfigError for an empty secret."""
    if secret is None:
        secret = os.environ.get("SPOTNIK_SECRET")
    if secret is None:
        path = Path(os.environ.get("SPOTNIK_SECRET_FILE", Path.home() / ".cache" / "spotnik" / "secret"))
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            # write then link: readers never see a half-written file, and only one secret wins
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        secret = path.read_text().strip()
    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        raise ConfigError("the job secret is empty (set SPOTNIK_SECRET or pass secret=)")
    return secret


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\x00".join(parts), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes; raises ConnectionError on EOF (the peer closed or died)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket (zero-copy); raises ConnectionError on EOF."""
    n = view.nbytes
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} payload bytes")
        got += k


@dataclass(frozen=True)
class Hello:
    """What a connector announces: who it is and which channel the connection carries."""

    member_id: str
    channel: str


def handshake_connect(sock: socket.socket, secret: bytes, run_id: str, hello: Hello) -> None:
    """Connector side. Blocks for at most the socket's timeout.

    Raises ProtocolError when the acceptor refuses (its reason is included) or fails to prove it
    knows the secret, ConnectionError/OSError on transport failure.
    """
    magic, version, nonce_a = _CHALLENGE.unpack(recv_exact(sock, _CHALLENGE.size))
    if magic != MAGIC:
        raise ProtocolError("peer is not a spotnik ring port (bad magic)")
    nonce_c = secrets.token_bytes(16)
    names = [run_id.encode(), hello.member_id.encode(), hello.channel.encode()]
    if any(len(n) > MAX_NAME for n in names):
        raise ConfigError("run id, member id and channel must be at most 255 bytes")
    mac = _mac(secret, b"c", nonce_a, nonce_c, str(PROTOCOL_VERSION).encode(), *names)
    sock.sendall(_RESPONSE.pack(MAGIC, PROTOCOL_VERSION, nonce_c, mac, *map(len, names)) + b"".join(names))
    ok, proof = _VERDICT.unpack(recv_exact(sock, _VERDICT.size))
    if not ok:
        reason = recv_exact(sock, proof[0]).decode(errors="replace") if proof[0] else "refused"
        raise ProtocolError(f"handshake refused by peer: {reason}")
    if not hmac.compare_digest(proof, _mac(secret, b"a", nonce_c, nonce_a)):
        raise ProtocolError("peer failed to prove knowledge of the job secret")


def handshake_accept(sock: socket.socket, secret: bytes, run_id: str) -> Hello:
    """Acceptor side. Blocks for at most the socket's timeout.

    Returns the connector's Hello. Raises ProtocolError (after telling the connector why) on a
    wrong magic, version, run id or secret; ConnectionError/OSError on transport failure.
    """
    nonce_a = secrets.token_bytes(16)
    sock.sendall(_CHALLENGE.pack(MAGIC, PROTOCOL_VERSION, nonce_a))
    magic, version, nonce_c, mac, l1, l2, l3 = _RESPONSE.unpack(recv_exact(sock, _RESPONSE.size))
    if magic != MAGIC:
        raise ProtocolError("bad magic in handshake (not a spotnik peer)")
    raw = recv_exact(sock, l1 + l2 + l3)
    names = [raw[:l1], raw[l1 : l1 + l2], raw[l1 + l2 :]]

    def refuse(reason: str) -> ProtocolError:
        msg = reason.encode()[:255]
        try:
            sock.sendall(_VERDICT.pack(0, bytes([len(msg)]) + bytes(31)) + msg)
        except OSError:
            pass
        return ProtocolError(reason)

    if version != PROTOCOL_VERSION:
        raise refuse(f"protocol version {version} != {PROTOCOL_VERSION}")
    expected = _mac(secret, b"c", nonce_a, nonce_c, str(version).encode(), *names)
    if not hmac.compare_digest(mac, expected):
        raise refuse("bad secret (HMAC mismatch)")
    if names[0] != run_id.encode():
        raise refuse(f"run id {names[0].decode(errors='replace')!r} != {run_id!r}")
    sock.sendall(_VERDICT.pack(1, _mac(secret, b"a", nonce_c, nonce_a)))
    return Hello(member_id=names[1].decode(), channel=names[2].decode())


def pack_header(kind: int, epoch: int, seq: int, idx: int, length: int) -> bytes:
    return HEADER.pack(MAGIC, kind, epoch, seq, idx, length)


def unpack_header(raw: bytes, max_data: int) -> tuple[int, int, int, int, int]:
    """Validate a header; returns (kind, epoch, seq, idx, length). Raises ProtocolError."""
    magic, kind, epoch, seq, idx, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError("bad frame magic")
    if kind not in KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    limit = MAX_CTRL_BYTES if kind == KIND_CTRL else max_data
    if length > limit:
        raise ProtocolError(f"oversized frame: {length} bytes > limit {limit}")
    return kind, epoch, seq, idx, length


def encode_ctrl(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode_ctrl(payload: bytes) -> dict:
    try:
        msg = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"malformed control frame: {exc}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("control frame without a type")
    return msg


def pack_heartbeat(secret: bytes, epoch: int, member_id: str) -> bytes:
    mid = member_id.encode()
    return HEARTBEAT.pack(MAGIC, epoch, _mac(secret, b"hb", str(epoch).encode(), mid)[:16]) + mid


def unpack_heartbeat(secret: bytes, data: bytes) -> tuple[int, str] | None:
    """(epoch, sender id) of an authentic heartbeat, None for anything else."""
    if len(data) <= HEARTBEAT.size or len(data) > HEARTBEAT.size + MAX_NAME:
        return None
    magic, epoch, mac = HEARTBEAT.unpack(data[: HEARTBEAT.size])
    mid = data[HEARTBEAT.size :]
    if magic != MAGIC or not hmac.compare_digest(mac, _mac(secret, b"hb", str(epoch).encode(), mid)[:16]):
        return None
    return epoch, mid.decode(errors="replace")
