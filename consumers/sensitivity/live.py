"""Live analysis as a remote subscriber: join the (X, Y) table as episodes arrive over ZeroMQ,
recompute every N episodes, and write the outputs when the run ends or on Ctrl-C.

The subscriber takes ``run/``, ``variation/`` and ``episode/`` (``run/`` is what ends the loop:
a remote tool that filters it out never learns that the run is over). Declarations come from
the run's ``RunStart`` and ``RunEnd``. Recomputations run on a worker thread, so the receive
loop keeps draining the socket (a lossless publisher is never held up by the analysis for
longer than its queue takes to fill); results computed before the run ends are provisional
until :data:`consumers.sensitivity.analysis.CONVERGENCE_RULE` holds.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker import EpisodeEnd, RunEnd, RunStart, Subscriber, VariationSample
from broker.zmq_subscriber import Gap

from ..errors import SampleTableError
from ..sample_table import SampleArrays, SampleTable
from .analysis import CONVERGENCE_FRACTIONS, Analysis, analyze
from .methods import DEFAULT_METHODS

__all__ = ["LIVE_TOPICS", "LiveResult", "run_live"]

LIVE_TOPICS = ("run/", "variation/", "episode/")
_SAID_REJECTED = 5  # rejected messages described in a status line each; the rest are counted


@dataclass(slots=True)
class LiveResult:
    """What a live analysis saw and wrote.

    Attributes:
        run: The run analysed (``None`` if no message arrived).
        analysis: The final analysis (``None`` without episodes).
        paths: Output file name -> path (empty without episodes).
        ended: The run's ``RunEnd`` arrived.
        interrupted: Stopped by Ctrl-C (or ``stop``) before the run's end.
        episodes: Finished episodes received.
        gaps: Messages the subscriber reported lost.
        rejected: Messages left out because they did not fit the run (a world outside it, a
            value that does not match its worlds: :class:`consumers.errors.SampleTableError`).
        recomputed: Provisional analyses made while the run was going.
        declarations: The variation declarations received.
        arrays: The (X, Y) table the final analysis used (``None`` without episodes).
    """

    run: str | None = None
    analysis: Analysis | None = None
    paths: dict[str, Path] = field(default_factory=dict)
    ended: bool = False
    interrupted: bool = False
    episodes: int = 0
    gaps: int = 0
    rejected: int = 0
    recomputed: int = 0
    declarations: dict[str, Any] = field(default_factory=dict)
    arrays: SampleArrays | None = None


def run_live(
    endpoint: str | Sequence[str],
    *,
    out: str | Path | None = None,
    run: str | None = None,
    every: int = 200,
    outputs: Sequence[str] | None = None,
    methods: Sequence[str] = DEFAULT_METHODS,
    seed: int = 0,
    resamples: int = 100,
    bins: int = 10,
    fractions: Sequence[float] = CONVERGENCE_FRACTIONS,
    stop: threading.Event | None = None,
    on_result: Callable[[Analysis], None] | None = None,
    on_status: Callable[[str], None] | None = None,
    subscriber: Mapping[str, Any] | None = None,
) -> LiveResult:
    """Analyse one run live until its ``RunEnd`` (or Ctrl-C, or ``stop``), then write outputs.

    Args:
        endpoint: Where the publisher (or proxy) is; the subscriber connects.
        out: Output folder; ``None``: ``./runs/sensitivity/<run>``
            (:func:`consumers.sensitivity.report.default_folder`: the run id, which the
            publisher chose, as one folder name).
        run: Analyse this run id; ``None``: the first run heard from (others are ignored).
        every: Recompute after this many new episodes.
        outputs, methods, seed, resamples, bins, fractions: As
            :func:`consumers.sensitivity.analyze`.
        stop: Set it (from any thread) to stop as Ctrl-C would.
        on_result: Called with each provisional analysis and then the final one.
        on_status: Called with status lines (subscribed, recomputing, ended, written).
        subscriber: Extra keyword arguments of :class:`broker.Subscriber`.

    Raises:
        TransportError: The endpoint cannot be connected.
        SensitivityError: The final analysis cannot run (e.g. no factor in the table).
    """
    say = on_status or (lambda _line: None)
    result = LiveResult(run=run)
    table = SampleTable()
    declarations: dict[str, Any] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="worldtap-sensitivity")
    pending: concurrent.futures.Future[Analysis] | None = None
    next_at = every
    kwargs: dict[str, Any] = {"outputs": outputs, "methods": methods, "seed": seed,
                              "resamples": resamples, "bins": bins, "fractions": fractions}

    def collect(block: bool) -> None:
        nonlocal pending
        if pending is None or not (block or pending.done()):
            return
        done, pending = pending, None
        try:
            provisional = done.result()
        except Exception as exc:  # a provisional failure (too few rows...) is reported, not fatal
            say(f"provisional analysis skipped: {exc}")
            return
        result.recomputed += 1
        if on_result is not None:
            on_result(provisional)

    sub = Subscriber(endpoint, topics=LIVE_TOPICS, **dict(subscriber or {}))
    try:
        say(f"subscribed to {', '.join(sub.endpoints)} (topics {', '.join(LIVE_TOPICS)}); "
            f"waiting for a run")
        try:
            while stop is None or not stop.is_set():
                item = sub.recv(timeout=0.1)
                collect(block=False)
                if item is None:
                    continue
                if isinstance(item, Gap):
                    if result.run is None or item.run == result.run:
                        result.gaps += item.missing
                        say(f"{item.missing} message(s) lost on {item.topic!r}")
                    continue
                if result.run is None:
                    result.run = item.run
                    say(f"analysing run {item.run!r}")
                if item.run != result.run:
                    continue
                if isinstance(item, RunStart | RunEnd):
                    table(item)  # the run's worlds, which bound the samples' and ends' worlds
                    declarations.update({k: dict(v) for k, v in item.variations.items()})
                    if isinstance(item, RunEnd):
                        result.ended = True
                        say(f"run {item.run!r} ended after {len(table)} episodes")
                        break
                    continue
                if isinstance(item, VariationSample | EpisodeEnd):
                    first = len(table) == 0
                    try:
                        table(item)
                    except SampleTableError as exc:  # the message changed nothing
                        result.rejected += 1
                        if result.rejected <= _SAID_REJECTED:
                            say(f"message {item.seq} left out: {exc}"
                                f"{'' if result.rejected < _SAID_REJECTED else ' (further ones are only counted)'}")
                        continue
                    if first and len(table):
                        say(f"receiving finished episodes of run {result.run!r}")
                if len(table) >= next_at and pending is None:
                    next_at = len(table) + every
                    say(f"recomputing on {len(table)} episodes")
                    pending = pool.submit(analyze, table.arrays(), dict(declarations),
                                          run=result.run, **kwargs)
            else:
                result.interrupted = True
        except KeyboardInterrupt:
            result.interrupted = True
        if result.interrupted:
            say(f"interrupted after {len(table)} episodes; writing what arrived")
    finally:
        sub.close()
        if result.interrupted:  # do not wait for a provisional result nobody will see
            pool.shutdown(wait=False, cancel_futures=True)
        else:
            try:
                collect(block=True)
            finally:
                pool.shutdown(wait=True)
    if result.rejected:
        say(f"{result.rejected} message(s) left out of the analysis")
    result.episodes = len(table)
    result.declarations = declarations
    if len(table) == 0:
        say("no finished episodes arrived; nothing to analyse")
        return result
    say(f"final analysis on {len(table)} episodes")
    result.arrays = table.arrays()
    final = analyze(result.arrays, declarations, run=result.run, progress=say, **kwargs)
    result.analysis = final
    from .report import default_folder, write_outputs

    folder = Path(out) if out is not None else default_folder(str(result.run))
    result.paths = write_outputs(final, folder)
    say(f"wrote {folder}")
    if on_result is not None:
        on_result(final)
    return result
