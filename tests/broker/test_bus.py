from __future__ import annotations

import logging

import pytest
import torch

from broker import Batch, Broker, BrokerClosedError, ConsumerError, EpisodeEnd


def _batch(topic: str = "batch/obs", value: float = 1.0) -> Batch:
    worlds = torch.arange(2)
    return Batch("run", 0, 0, topic, worlds, torch.zeros(2, dtype=torch.int64),
                 {"x": torch.full((2, 3), value)})


def _end() -> EpisodeEnd:
    w = torch.arange(2)
    f = torch.zeros(2, dtype=torch.bool)
    return EpisodeEnd("run", 1, 0, w, w, f, f, f, w)


def test_delivers_by_prefix_in_subscription_order() -> None:
    b = Broker(strict=True)
    seen: list[tuple[str, str]] = []
    b.subscribe("batch/", lambda m: seen.append(("a", m.topic)))
    b.subscribe("", lambda m: seen.append(("b", m.topic)))
    b.subscribe("batch/obs", lambda m: seen.append(("c", m.topic)))
    b.subscribe("episode/", lambda m: seen.append(("d", m.topic)))
    b.publish(_batch())
    b.publish(_batch("batch/act"))
    b.publish(_end())
    assert seen == [("a", "batch/obs"), ("b", "batch/obs"), ("c", "batch/obs"),
                    ("a", "batch/act"), ("b", "batch/act"),
                    ("b", "episode/end"), ("d", "episode/end")]


def test_passes_the_message_itself_without_copying() -> None:
    b = Broker()
    got: list[Batch] = []
    b.subscribe("", got.append)  # type: ignore[arg-type]
    msg = _batch()
    b.publish(msg)
    assert got[0] is msg
    assert got[0].fields["x"].data_ptr() == msg.fields["x"].data_ptr()


def test_a_raising_consumer_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    b = Broker()
    seen: list[str] = []

    def bad(message: object) -> None:
        raise RuntimeError("boom")

    b.subscribe("", lambda m: seen.append("first"))
    b.subscribe("", bad, name="bad-consumer")
    b.subscribe("", lambda m: seen.append("last"))
    with caplog.at_level(logging.ERROR, logger="worldtap.broker"):
        b.publish(_batch())
        b.publish(_batch())
    assert seen == ["first", "last", "first", "last"]
    stats = b.statistics()
    assert stats.consumer_errors == 2
    assert stats.errors_by_consumer == {"bad-consumer": 2}
    assert stats.deliveries == 4
    assert stats.published == 2
    assert "bad-consumer" in caplog.text


def test_strict_mode_reraises_after_delivering_to_everyone(caplog: pytest.LogCaptureFixture) -> None:
    b = Broker(strict=True)
    seen: list[str] = []

    def bad(message: object) -> None:
        raise KeyError("missing")

    b.subscribe("", bad, name="picky")
    b.subscribe("", lambda m: seen.append("after"))
    with pytest.raises(ConsumerError, match=r"consumer 'picky' raised on topic 'batch/obs': KeyError") as info:
        b.publish(_batch())
    assert seen == ["after"]
    assert isinstance(info.value.__cause__, KeyError)
    assert info.value.consumer == "picky"
    assert b.statistics().errors_by_consumer == {"picky": 1}


def test_cancel_and_close() -> None:
    b = Broker(strict=True)
    seen: list[str] = []
    sub = b.subscribe("", lambda m: seen.append(m.topic))
    b.publish(_batch())
    sub.cancel()
    sub.cancel()
    b.publish(_batch())
    assert seen == ["batch/obs"]
    assert b.statistics().subscriptions == 0
    b.close()
    assert b.statistics().closed
    with pytest.raises(BrokerClosedError, match="publish\\(\\) on a closed broker"):
        b.publish(_batch())
    with pytest.raises(BrokerClosedError, match="subscribe\\(\\) on a closed broker"):
        b.subscribe("", print)


def test_rejects_bad_subscriptions() -> None:
    b = Broker()
    with pytest.raises(TypeError, match="consumer: expected a callable"):
        b.subscribe("", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="topic_prefix: expected a str, got b'x'"):
        b.subscribe(b"x", print)  # type: ignore[arg-type]


def test_consumer_names_come_from_name_attribute_or_qualname() -> None:
    class Named:
        name = "my-consumer"

        def __call__(self, message: object) -> None:
            pass

    def plain(message: object) -> None:
        pass

    b = Broker()
    assert b.subscribe("", Named()).name == "my-consumer"
    assert b.subscribe("", plain).name.endswith("plain")
