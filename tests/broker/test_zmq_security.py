"""CURVE encryption and authentication, key files and the ``worldtap-keys`` command."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker import (
    Batch,
    CurveClient,
    CurveServer,
    KeyPair,
    SecurityError,
    Subscriber,
    ZmqPublisher,
    load_keypair,
    load_public_keys,
)
from broker.keys import main
from broker.security import is_loopback, load_public_key

MakePub = Callable[..., ZmqPublisher]
MakeSub = Callable[..., Subscriber]


def test_right_keys_receive_and_wrong_or_no_keys_receive_nothing(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str],
        batch: Callable[..., Batch]) -> None:
    server, client, stranger = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    pub = make_pub(free_endpoint(), curve=CurveServer(server, allowed_clients=frozenset({client.public})))
    ep = pub.endpoints[0]
    good = make_sub(ep, curve=CurveClient(client, server.public))
    wrong_client = make_sub(ep, curve=CurveClient(stranger, server.public))  # not on the allow-list
    wrong_server = make_sub(ep, curve=CurveClient(client, KeyPair.generate().public))
    plain = make_sub(ep)
    pub.wait_for_subscribers(1, timeout=10)
    for i in range(3):
        pub(batch(i))
    assert [good.recv(timeout=5).seq for _ in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    for sub in (wrong_client, wrong_server, plain):
        assert sub.recv(timeout=0.3) is None
    assert pub.statistics().subscribers == 1


def test_allow_any_client_still_encrypts(make_pub: MakePub, make_sub: MakeSub,
                                         free_endpoint: Callable[[], str], batch: Callable[..., Batch]) -> None:
    server = KeyPair.generate()
    pub = make_pub(free_endpoint(), curve=CurveServer(server, allowed_clients=None))
    sub = make_sub(pub.endpoints[0], curve=CurveClient(KeyPair.generate(), server.public))
    plain = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    pub(batch(0))
    assert isinstance(sub.recv(timeout=5), Batch)
    assert plain.recv(timeout=0.3) is None


def test_key_files_from_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str],
                                    batch: Callable[..., Batch]) -> None:
    assert main([str(tmp_path / "server"), "--name", "server"]) == 0
    out = capsys.readouterr().out
    assert f"public key file: {tmp_path / 'server' / 'server.key'}" in out
    assert main([str(tmp_path / "client"), "--name", "daemon"]) == 0
    secret = tmp_path / "client" / "daemon.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(tmp_path / "client" / "daemon.key", allowed)  # the allow-list: clients' public files
    server = CurveServer(load_keypair(tmp_path / "server" / "server.key_secret"), load_public_keys(allowed))
    client = CurveClient(load_keypair(secret), load_public_key(tmp_path / "server" / "server.key"))
    assert load_public_key(tmp_path / "server" / "server.key").decode() in out
    pub = make_pub(free_endpoint(), curve=server)
    sub = make_sub(pub.endpoints[0], curve=client)
    pub.wait_for_subscribers(1, timeout=10)
    pub(batch(0))
    assert isinstance(sub.recv(timeout=5), Batch)


def test_command_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 0
    first = (tmp_path / "worldtap.key").read_bytes()
    assert main([str(tmp_path)]) == 1
    assert "worldtap.key' exists (pass overwrite=True / --force)" in capsys.readouterr().err
    assert (tmp_path / "worldtap.key").read_bytes() == first
    assert main([str(tmp_path), "--force"]) == 0
    assert (tmp_path / "worldtap.key").read_bytes() != first
    assert main([str(tmp_path), "--name", "../up"]) == 1
    assert "expected a plain file name for the key pair, got '../up'" in capsys.readouterr().err


def test_console_entry_point(tmp_path: Path) -> None:
    exe = shutil.which("worldtap-keys")
    cmd = [exe] if exe else [sys.executable, "-m", "broker.keys"]
    done = subprocess.run([*cmd, str(tmp_path), "--name", "node1"], capture_output=True, text=True,
                          timeout=60, check=False, env={**os.environ, "PYTHONWARNINGS": "error"})
    assert done.returncode == 0, done.stderr
    assert "secret key file:" in done.stdout
    assert (tmp_path / "node1.key_secret").exists()
    bad = subprocess.run([*cmd], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2
    assert "the following arguments are required: directory" in bad.stderr


@pytest.mark.parametrize(("call", "match"), [
    (lambda: CurveClient(KeyPair.generate(), b"short"), "expected a 40-character Z85 CURVE key .*got 5 bytes"),
    (lambda: CurveClient(KeyPair.generate(), b"~" * 40), "not a valid Z85 CURVE key"),
    (lambda: CurveServer(KeyPair(KeyPair.generate().public), None), "the server needs its secret key"),
    (lambda: CurveClient(KeyPair(KeyPair.generate().public), KeyPair.generate().public),
     "the client needs its secret key"),
    (lambda: load_keypair("/nonexistent/x.key_secret"), "cannot load a CURVE key from '/nonexistent"),
    (lambda: load_public_keys("/nonexistent"), "expected a folder of .key files"),
])
def test_bad_keys_are_security_errors(call: Callable[[], Any], match: str) -> None:
    with pytest.raises(SecurityError, match=match):
        call()


def test_secret_never_printed() -> None:
    keys = KeyPair.generate()
    assert keys.secret is not None
    assert keys.secret.decode() not in repr(keys)


@pytest.mark.parametrize(("endpoint", "local"), [
    ("tcp://127.0.0.1:5555", True), ("tcp://localhost:1", True), ("ipc:///tmp/x", True),
    ("inproc://x", True), ("tcp://[::1]:5", True), ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False),
    ("tcp://10.0.0.2:5555", False), ("tcp://127.0.0.1:0;10.1.1.1:5555", False),
    ("tcp://[::1]:5555", True), ("tcp://127.0.0.2:1", True), ("ipc://@abstract", True),
    ("tcp://10.0.0.2:0;127.0.0.1:5555", True), ("tcp://[::ffff:127.0.0.1]:5555", True),
    ("tcp://LOCALHOST:1", True),
    # Names that only start like loopback leave the host:
    ("tcp://127.0.0.1.attacker.example:5555", False), ("tcp://localhost.attacker.example:5555", False),
    ("tcp://127.1:5555", False), ("tcp://[::2]:5555", False), ("tcp://lo:5555", False),
    ("tcp://[::ffff:10.0.0.1]:5555", False), ("udp://127.0.0.1:5555", False),
])
def test_is_loopback(endpoint: str, local: bool) -> None:
    """The host is parsed as an IP address: ``is_loopback`` used to trust any name starting
    with ``127.`` (``tcp://127.0.0.1.attacker.example`` counted as loopback)."""
    assert is_loopback(endpoint) is local
