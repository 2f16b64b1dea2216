"""The recorder's topic schemas: one :class:`bk.TopicSchema` per topic, checked by name.

The broker package is imported as a module (``bk``, not ``from broker import TopicSchema``) so
that each test fails on its own against code that has no shared schema type, rather than the
whole file failing to import.
"""

from __future__ import annotations

import pytest
import torch

import broker as bk
from broker import Batch, Broker, FieldSpec, Message, RunEnd, RunStart
from broker.wire import decode, encode
from capture import FunctionTerm, Recorder, SchemaError, TermError
from consumers import Retention

N = 3
STEPS = 4


def _payload(step: int) -> dict[str, torch.Tensor]:
    """Two fields of one dtype and shape, so that a copy by position cannot be told from a
    copy by name by dtype or shape checks: only the bytes differ."""
    base = float(100 * step)
    return {"a": torch.arange(N * 2, dtype=torch.float32).reshape(N, 2) + base,
            "b": -torch.arange(N * 2, dtype=torch.float32).reshape(N, 2) - base - 0.5}


def test_fields_in_another_dict_order_are_accepted_and_recorded_by_name(broker: Broker) -> None:
    """Bug: with the fields of a later batch in another dict order (same names and specs),
    the recorder's check was order-blind while retention copied by position, so field ``a`` was
    retained with ``b``'s bytes. The recorder accepts the batch, publishes each tensor under its
    own name, and what retention keeps and what the wire carries match it byte for byte by name.
    """
    published: list[Message] = []
    broker.subscribe("", published.append)
    retention = Retention(num_worlds=N)
    retention.attach(broker)
    sent: list[dict[str, torch.Tensor]] = []

    def post_step() -> dict[str, torch.Tensor]:
        fields = _payload(len(sent))
        if len(sent) % 2:  # every other step, the same fields in the other order
            fields = {"b": fields["b"], "a": fields["a"]}
        sent.append(fields)
        return fields

    rec = Recorder(N, "cpu", broker, run="order")
    rec.add_term("t", FunctionTerm(post_step=post_step))
    for _ in range(STEPS):
        rec.record_post_step()
    assert [list(f) for f in sent] == [["a", "b"], ["b", "a"]] * (STEPS // 2)

    batches = [m for m in published if isinstance(m, Batch)]
    assert len(batches) == STEPS
    for batch, fields in zip(batches, sent, strict=True):
        assert batch.fields.keys() == fields.keys()
        for name, tensor in fields.items():
            assert batch.fields[name] is tensor  # borrowed, under its own name
        # The wire carries each field under its name, byte for byte.
        back = decode([bytes(f) for f in encode(batch)])
        assert isinstance(back, Batch)
        for name, tensor in fields.items():
            assert back.fields[name].numpy().tobytes() == tensor.numpy().tobytes(), name

    # Retention keeps, per world, each field's rows by name, byte for byte.
    for world in range(N):
        kept = retention.episode(world)["t"]
        for name in ("a", "b"):
            want = torch.stack([f[name][world] for f in sent])
            assert kept[name].numpy().tobytes() == want.numpy().tobytes(), (world, name)

    rec.close()
    end = next(m for m in published if isinstance(m, RunEnd))
    spec = FieldSpec("float32", (2,))
    assert end.schema == {"batch/t": {"a": spec, "b": spec}}
    assert rec.schema() == end.schema
    assert bk.TopicSchema(end.schema["batch/t"]) == bk.TopicSchema.of(sent[1], topic="batch/t")


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"a": torch.zeros(N, 2, dtype=torch.float64)},
         r"topic 'batch/t' field 'a': expected float32 per-world shape \(2,\), got float64 per-world shape \(2,\)"),
        ({"b": torch.zeros(N, 3)},
         r"topic 'batch/t' field 'b': expected float32 per-world shape \(2,\), got float32 per-world shape \(3,\)"),
        ({"b": torch.zeros(N, 2, 1)},
         r"topic 'batch/t' field 'b': expected float32 per-world shape \(2,\), got float32 per-world shape \(2, 1\)"),
    ],
)
def test_a_field_with_the_same_name_but_another_spec_is_refused_by_name(
    broker: Broker, changed: dict[str, torch.Tensor], message: str
) -> None:
    """Bug: a schema check of its own in the recorder, with its own error type: the refusal must
    come from the one shared check (:meth:`bk.TopicSchema.check`), name the field, and be a
    :class:`bk.SchemaError`, so one ``except`` catches the recorder's, retention's and the
    daemon's refusals alike. Nothing of the refused batch is published."""
    published: list[Message] = []
    broker.subscribe("", published.append)
    out: dict[str, torch.Tensor] = _payload(0)
    rec = Recorder(N, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: out))
    rec.record_post_step()
    before = len(published)
    # The other dict order, with one field changed.
    out = {"b": changed.get("b", out["b"]), "a": changed.get("a", out["a"])}
    with pytest.raises(bk.SchemaError, match=message) as info:
        rec.record_post_step()
    assert isinstance(info.value, SchemaError)  # capture's own leaf of the shared type
    assert isinstance(info.value.__cause__, bk.SchemaError)
    assert len(published) == before
    assert rec.step == 1
    # The message is the one bk.TopicSchema.check writes for the same fields.
    first = bk.TopicSchema.of(_payload(0), topic="batch/t")
    with pytest.raises(bk.SchemaError) as shared:
        first.check(out, topic="batch/t")
    assert str(info.value) == str(shared.value)


def test_one_except_clause_catches_the_recorders_and_retentions_schema_errors() -> None:
    """Bug: the recorder's SchemaError and retention's were unrelated types."""
    import consumers

    assert issubclass(SchemaError, bk.SchemaError)
    assert issubclass(consumers.RetentionSchemaError, bk.SchemaError)


def test_missing_and_extra_fields_are_refused_naming_them(broker: Broker) -> None:
    out: dict[str, torch.Tensor] = _payload(0)
    rec = Recorder(N, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: out))
    rec.record_post_step()
    out = {"b": out["b"], "c": out["a"]}
    with pytest.raises(SchemaError, match=r"topic 'batch/t': expected fields \['a', 'b'\], got \['b', 'c'\] "
                                          r"\(missing \['a'\], extra \['c'\]\)"):
        rec.record_post_step()


def test_run_start_and_end_carry_the_schema_in_canonical_order(broker: Broker) -> None:
    """RunStart/RunEnd schemas are plain ``dict[topic, dict[field, FieldSpec]]``; the fields
    come in the TopicSchema's canonical order (sorted names), whatever order the first batch
    had, so the encoded header does not depend on a term's dict order."""
    published: list[Message] = []
    broker.subscribe("run/", published.append)
    rec = Recorder(N, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: {"z": torch.zeros(N), "a": torch.zeros(N, 1, dtype=torch.int8)}))
    rec.record_post_step()
    rec.close()
    start, end = published
    assert isinstance(start, RunStart)
    assert isinstance(end, RunEnd)
    assert start.schema == {}
    assert type(end.schema["batch/t"]) is dict
    assert list(end.schema["batch/t"]) == ["a", "z"]
    assert end.schema["batch/t"] == {"a": FieldSpec("int8", (1,)), "z": FieldSpec("float32", ())}


def test_two_fields_that_flatten_to_one_name_are_refused(broker: Broker) -> None:
    """Bug: ``{"a/b": x, "a": {"b": y}}`` flattened to one field ``a/b`` holding ``y``; ``x``
    was silently dropped from every batch. The term's output is refused naming the field."""
    published: list[Message] = []
    broker.subscribe("", published.append)
    rec = Recorder(N, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: {"a/b": torch.zeros(N), "a": {"b": torch.ones(N)}}))
    with pytest.raises(TermError, match=r"term 't': field 'a/b': named twice"):
        rec.record_post_step()
    assert not [m for m in published if isinstance(m, Batch)]
    assert rec.schema() == {}
