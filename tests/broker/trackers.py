"""A stand-in for ZeroMQ's message tracker, shared by the staging-ring tests."""

from __future__ import annotations

import zmq


class FakeTracker:
    """A :class:`zmq.MessageTracker` whose completion the test decides:
    ``done``, and ``wait(timeout)`` raising :class:`zmq.NotDone` until it is finished."""

    def __init__(self) -> None:
        self.finished = False

    @property
    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float = -1) -> None:
        if not self.finished:
            raise zmq.NotDone
