"""Checks of a store against what a simulation published (shared by the fault and kill tests)."""

from __future__ import annotations

import zarr
from storage_sim import Sim, assert_episode_equal

from broker import Batch, EpisodeEnd, Message, VariationSample
from storage import RunStore
from storage._format import StoreLocation, local_path, open_store


class Spans:
    """Broker consumer: the run sequence numbers each (world, episode) depends on, from the
    boundary that starts it (the world's previous ``EpisodeEnd``, or the run's start: a daemon
    that misses the boundary cannot know the episode is whole) to its last message."""

    def __init__(self) -> None:
        self.first: dict[tuple[int, int], int] = {}
        self.last: dict[tuple[int, int], int] = {}

    def __call__(self, msg: Message) -> None:
        if isinstance(msg, Batch | EpisodeEnd | VariationSample):
            for w, e in zip(msg.worlds.tolist(), msg.episodes.tolist(), strict=True):
                self.first.setdefault((w, e), 0)
                self.last[(w, e)] = msg.seq
                if isinstance(msg, EpisodeEnd):
                    self.first[(w, e + 1)] = msg.seq


def check_store(location: StoreLocation, sim: Sim, spans: Spans, run: str, what: str) -> int:
    """The store's promise for ``run`` (any backend); returns the number of stored episodes."""
    reader = RunStore(location)
    assert reader.damaged() == {}, what
    info = reader.info(run)
    assert info["status"] == "complete", what
    stored = reader.episodes(run)
    keys = {(int(r["world"]), int(r["index"])) for r in stored.rows()}
    for row in stored.rows():
        key = (int(row["world"]), int(row["index"]))
        assert row["success"] == sim.outcome[key], (what, key)
        assert_episode_equal(reader.episode(run, *key), sim.arrays(key))
    gaps = reader.gaps(run).rows()
    for key in sorted(set(sim.outcome) - keys):
        a, b = spans.first[key], spans.last[key]
        assert any(g["source"] in (1, 2, 3) and a < g["received"] and b >= g["expected"] for g in gaps), \
            f"{what}: episode {key} (seq {a}..{b}) is missing but lies in no recorded gap {gaps}"
    # nothing partial is visible, even to plain zarr: arrays are cut to their committed rows
    root = zarr.open_group(open_store(location, read_only=True), mode="r")
    committed = info["committed"]
    assert root[f"runs/{run}/episodes/world"].shape[0] == committed["episodes"], what
    for term, rows in committed["rows"].items():
        assert root[f"runs/{run}/data/{term}/_step"].shape[0] == rows, (what, term)
    path = local_path(location)
    debris = [] if path is None else sorted(str(p.relative_to(path)) for p in path.rglob("*.partial"))
    assert not debris, (what, debris)
    return len(keys)


def replay(run: str, seed: int, steps: int, worlds: int = 6) -> tuple[Sim, Spans]:
    """What a publisher script (``proxy_sim.py``, ``partition_pub.py``) running ``Sim`` with
    this run, seed and steps published: the simulation and the spans of its messages."""
    from broker import Broker

    broker = Broker()
    spans = Spans()
    broker.subscribe("", spans)
    sim = Sim(broker, worlds, run=run, seed=seed)
    sim.step(steps)
    sim.close()
    return sim, spans

