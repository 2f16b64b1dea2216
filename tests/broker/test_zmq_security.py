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
from waiting import wait_until

from broker import (
    Batch,
    CurveClient,
    CurveServer,
    KeyPair,
    SecurityError,
    Subscriber,
    SubscriberTimeoutError,
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


def test_failed_handshakes_are_reported_on_both_sides(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str],
        batch: Callable[..., Batch]) -> None:
    """A refused key, a wrong server key and a plain-text subscriber each show up, by cause,
    in the publisher's statistics and its wait_for_subscribers error, and in each
    subscriber's statistics. Bugs caught: handshake failures that are silent (the publisher
    only says "0 joined", the subscriber just waits), a cause misnamed, a subscriber whose
    handshake succeeded reported as failing."""
    server, client = KeyPair.generate(), KeyPair.generate()
    pub = make_pub(free_endpoint(), curve=CurveServer(server, allowed_clients=frozenset({client.public})))
    ep = pub.endpoints[0]
    refused = make_sub(ep, curve=CurveClient(KeyPair.generate(), server.public))
    wrong_server = make_sub(ep, curve=CurveClient(client, KeyPair.generate().public))
    plain = make_sub(ep)
    causes = {
        refused: "the publisher refused this key: is its public key on the publisher's allow-list?",
        wrong_server: ("the publisher dropped the handshake: is the server public key the "
                       "publisher's, this key on its allow-list, and CURVE used on both sides?"),
        plain: "the publisher uses CURVE and this subscriber does not, or the reverse",
    }
    for sub, cause in causes.items():
        # (a connection closed mid-handshake is reported without detail first, at times)
        wait_until(lambda s=sub, c=cause: s.recv(timeout=0.01) is None
                   and list(s.statistics().failing_endpoints.values()) == [c],
                   f"the subscriber to report {cause!r}", poll=0.01)
        stats = sub.statistics()
        assert stats.handshake_failures >= 1
        assert list(stats.failing_endpoints.values()) == [cause]
    # The plain-text subscriber may hang up first: its cause at the publisher is either.
    expected = {"a subscriber's key is not on the allow-list", "a subscriber has the wrong server public key"}
    plain_causes = {"a subscriber uses CURVE and this publisher does not, or the reverse",
                    "a peer dropped the connection during the handshake"}

    def seen() -> bool:
        for sub in causes:  # receiving lets a refused subscriber connect again
            sub.recv(timeout=0.01)
        got = set(pub.statistics().handshake_causes)
        return expected <= got and bool(plain_causes & got)

    wait_until(seen, "the publisher to count every refused handshake", poll=0.01)
    with pytest.raises(SubscriberTimeoutError) as error:
        pub.wait_for_subscribers(1, timeout=0.2)
    assert "0 joined; " in str(error.value)
    for cause in expected:
        assert f"CURVE handshake(s) failed ({cause})" in str(error.value)
    assert any(f"CURVE handshake(s) failed ({cause})" in str(error.value) for cause in plain_causes)
    stats = pub.statistics()
    assert stats.handshake_failures == sum(stats.handshake_causes.values())
    good = make_sub(ep, curve=CurveClient(client, server.public))
    pub.wait_for_subscribers(1, timeout=10)
    pub(batch(0))
    got = good.recv(timeout=5)
    assert isinstance(got, Batch)
    assert got.fields["x"].numpy().tobytes() == batch(0).fields["x"].numpy().tobytes()
    assert good.statistics().handshake_failures == 0
    assert dict(good.statistics().failing_endpoints) == {}


def test_proxy_counts_refused_peers_by_side(make_sub: MakeSub) -> None:
    """Bugs caught: a proxy that refuses a subscriber's key in silence (nothing counted, no
    status field), or that counts it on the wrong side."""
    from broker.proxy import Proxy, _status

    server = KeyPair.generate()
    proxy = Proxy("tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                  backend_curve=CurveServer(server, allowed_clients=frozenset())).start()
    try:
        sub = make_sub(proxy.backend_endpoints[0], curve=CurveClient(KeyPair.generate(), server.public))
        refused = "a subscriber's key is not on the allow-list"

        def counted() -> bool:  # by both sides: each learns of the refusal on its own monitor
            sub.recv(timeout=0.01)
            return (proxy.statistics().handshake_failures.get("backend", {}).get(refused, 0) >= 1
                    and bool(sub.statistics().failing_endpoints))

        wait_until(counted, "the proxy and the subscriber to count the refusal", poll=0.01)
        stats = proxy.statistics()
        assert set(stats.handshake_failures) == {"backend"}
        assert f"backend_handshakes_failed={sum(stats.handshake_failures['backend'].values())}" in _status(stats)
        assert list(sub.statistics().failing_endpoints.values()) == [
            "the publisher refused this key: is its public key on the publisher's allow-list?"]
    finally:
        proxy.close()


def test_a_publisher_whose_authenticator_fails_to_start_lets_its_context_go(
        monkeypatch: pytest.MonkeyPatch, free_endpoint: Callable[[], str]) -> None:
    """Before, the CURVE authenticator started outside the constructor's cleanup: when it
    failed, the publisher's ZeroMQ context (and its I/O thread) stayed open. Now the error
    propagates and the context is terminated; a failing configure stops the started thread."""
    import zmq

    import broker.zmq_publisher as zp
    from broker.security import ThreadAuthenticator

    contexts: list[zmq.Context[Any]] = []

    class Recorded(zmq.Context):  # type: ignore[type-arg]
        def __init__(self) -> None:
            super().__init__()
            contexts.append(self)

    def fail(self: CurveServer, context: zmq.Context[Any]) -> Any:
        raise RuntimeError("injected: the authenticator did not start")

    monkeypatch.setattr(zp.zmq, "Context", Recorded)
    monkeypatch.setattr(CurveServer, "start_authenticator", fail)
    with pytest.raises(RuntimeError, match="injected"):
        ZmqPublisher(free_endpoint(), curve=CurveServer(KeyPair.generate(), allowed_clients=None))
    assert len(contexts) == 1
    assert contexts[0].closed
    monkeypatch.undo()

    stopped: list[bool] = []
    real_stop = ThreadAuthenticator.stop

    def configure(self: ThreadAuthenticator, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected: configure failed")

    def stop(self: ThreadAuthenticator) -> None:
        stopped.append(True)
        real_stop(self)

    monkeypatch.setattr(ThreadAuthenticator, "configure_curve", configure)
    monkeypatch.setattr(ThreadAuthenticator, "stop", stop)
    ctx = zmq.Context()
    try:
        with pytest.raises(RuntimeError, match="configure failed"):
            CurveServer(KeyPair.generate(), allowed_clients=None).start_authenticator(ctx)
        assert stopped  # the started thread was stopped
    finally:
        ctx.term()
