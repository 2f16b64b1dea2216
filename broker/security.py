"""CURVE keys and authentication for ZeroMQ endpoints that leave the host.

The publisher is the CURVE *server* (it holds the server key pair and an allow-list of client
public keys, enforced by a ``zmq.auth`` authenticator thread in its context); each subscriber is
a CURVE *client* with its own key pair and the server's public key. Key files are the ones
``zmq.auth.create_certificates`` writes (``<name>.key`` public, ``<name>.key_secret`` secret);
``worldtap-keys`` generates them. Keys are handled as 40-character Z85 ``bytes``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from .errors import SecurityError, translate_zmq_errors

_log = logging.getLogger("worldtap.broker.zmq")

__all__ = [
    "CurveClient",
    "attach",
    "CurveServer",
    "KeyPair",
    "is_loopback",
    "load_keypair",
    "load_public_key",
    "load_public_keys",
    "write_keypair",
]

_Z85_LEN = 40


def _z85(key: bytes | str, what: str) -> bytes:
    raw = key.encode("ascii") if isinstance(key, str) else bytes(key)
    if len(raw) == 32:
        return z85.encode(raw)
    if len(raw) != _Z85_LEN:
        raise SecurityError(f"{what}: expected a 40-character Z85 CURVE key (or 32 raw bytes), "
                            f"got {len(raw)} bytes")
    try:
        z85.decode(raw)
    except (ValueError, KeyError, IndexError) as exc:
        raise SecurityError(f"{what}: not a valid Z85 CURVE key: {raw!r}") from exc
    return raw


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A CURVE key pair (Z85). ``secret`` is ``None`` when only the public file was loaded."""

    public: bytes
    secret: bytes | None = None

    @classmethod
    def generate(cls) -> KeyPair:
        """A fresh key pair (kept in memory only)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def __repr__(self) -> str:  # never print a secret key
        return f"KeyPair(public={self.public!r}, secret={'<hidden>' if self.secret else None})"


@dataclass(frozen=True, slots=True)
class CurveServer:
    """Publisher-side CURVE settings.

    Attributes:
        keys: The server's key pair (secret required).
        allowed_clients: Z85 public keys of the clients allowed to connect, or ``None`` to
            accept any client that completes the CURVE handshake (encryption without
            authentication; say so explicitly).
        domain: The ZAP domain the allow-list applies to.
    """

    keys: KeyPair
    allowed_clients: frozenset[bytes] | None
    domain: str = "*"

    def __post_init__(self) -> None:
        if self.keys.secret is None:
            raise SecurityError("CurveServer.keys: the server needs its secret key, got a public key only")
        if self.allowed_clients is not None:
            object.__setattr__(self, "allowed_clients", frozenset(
                _z85(k, "CurveServer.allowed_clients") for k in self.allowed_clients))

    def apply(self, socket: zmq.Socket[Any]) -> None:
        """Make ``socket`` a CURVE server (before it binds or connects)."""
        socket.curve_secretkey = self.keys.secret
        socket.curve_publickey = self.keys.public
        socket.curve_server = True

    def start_authenticator(self, context: zmq.Context[Any]) -> ThreadAuthenticator:
        """Start the ``zmq.auth`` thread that enforces the allow-list for ``context``. The caller
        stops it (``.stop()``) before terminating the context."""
        auth = ThreadAuthenticator(context, log=None)
        auth.start()
        try:
            if self.allowed_clients is None:
                auth.configure_curve(domain=self.domain, location=zmq.auth.CURVE_ALLOW_ANY)
            else:
                auth.configure_curve_callback(domain=self.domain,
                                              credentials_provider=_AllowList(self.allowed_clients))
        except BaseException:
            auth.stop()
            raise
        return auth


class _AllowList:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


@dataclass(frozen=True, slots=True)
class CurveClient:
    """Subscriber-side CURVE settings: the client's own key pair and the server's public key."""

    keys: KeyPair
    server_public: bytes

    def __post_init__(self) -> None:
        if self.keys.secret is None:
            raise SecurityError("CurveClient.keys: the client needs its secret key, got a public key only")
        object.__setattr__(self, "server_public", _z85(self.server_public, "CurveClient.server_public"))

    def apply(self, socket: zmq.Socket[Any]) -> None:
        """Make ``socket`` a CURVE client of the server (before it binds or connects)."""
        socket.curve_secretkey = self.keys.secret
        socket.curve_publickey = self.keys.public
        socket.curve_serverkey = self.server_public


def write_keypair(directory: str | os.PathLike[str], name: str, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Generate a key pair into ``directory/<name>.key`` and ``<name>.key_secret`` (mode 0600).

    Returns:
        The public and the secret key file.

    Raises:
        FileExistsError: A file exists and ``overwrite`` is false.
        SecurityError: ``name`` is not a plain file name.
    """
    if not name or name != Path(name).name or name.startswith("."):
        raise SecurityError(f"name: expected a plain file name for the key pair, got {name!r}")
    folder = Path(directory)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists() and not overwrite:
            raise FileExistsError(f"key file {str(path)!r} exists (pass overwrite=True / --force)")
    folder.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(folder, name)
    secret.chmod(0o600)
    return public, secret


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"cannot load a CURVE key from {str(path)!r}: {exc}") from exc
    return _z85(public, str(path)), None if secret is None else _z85(secret, str(path))


def load_keypair(path: str | os.PathLike[str]) -> KeyPair:
    """Load a key pair from a ``.key_secret`` file (or only the public key from a ``.key`` file)."""
    public, secret = _load(path)
    return KeyPair(public, secret)


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key in a ``.key`` (or ``.key_secret``) file."""
    return _load(path)[0]


def load_public_keys(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """Every public key in the ``*.key`` files of ``directory`` (an allow-list)."""
    folder = Path(directory)
    if not folder.is_dir():
        raise SecurityError(f"directory: expected a folder of .key files, got {str(folder)!r}")
    return frozenset(load_public_key(p) for p in sorted(folder.glob("*.key")))


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint`` stays on this host: ``ipc://``, ``inproc://``, or ``tcp://`` whose
    host (the destination of ``tcp://source;destination``) is ``localhost`` or an IP address
    that :mod:`ipaddress` calls loopback (``127.0.0.0/8``, ``::1``, IPv4-mapped ``127.*``).
    Names are never matched by prefix: ``tcp://127.0.0.1.example.org:1`` leaves the host."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(";", 1)[-1].rpartition(":")[0]
    if host.lower() == "localhost":
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name other than localhost, "*", an interface: not known to be local
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def attach(sock: zmq.Socket[Any], endpoints: Sequence[str], *, bind: bool, encrypted: bool,
           owner: str) -> tuple[str, ...]:
    """Bind or connect ``sock`` to every endpoint and return them (bound wildcards resolved,
    e.g. ``tcp://127.0.0.1:*`` -> the port chosen). Closes ``sock`` if one fails.

    A plain-text endpoint that leaves the host is logged as a warning: use CURVE there.

    Raises:
        TransportError: An endpoint could not be bound or connected.
    """
    actual = []
    try:
        for ep in endpoints:
            if not encrypted and not is_loopback(ep):
                _log.warning("%s: %r leaves this host without CURVE encryption", owner, ep)
            with translate_zmq_errors(f"{'bind' if bind else 'connect'} {ep!r}"):
                if bind:
                    sock.bind(ep)
                    actual.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
                else:
                    sock.connect(ep)
                    actual.append(ep)
    except BaseException:
        sock.close(linger=0)
        raise
    return tuple(actual)
