"""Keep freed memory for reuse in a process that receives large messages (glibc's malloc).

Each message ZeroMQ receives is a new allocation of its size, made by ZeroMQ's I/O thread and
freed wherever the message is let go. glibc's malloc returns the free top of a heap to the
system once it exceeds a trim threshold, which it adapts to twice the largest block freed so
far. With several messages in flight, the freed top passes that threshold at nearly every
message, so every page of the next message's buffer is faulted in again (and every free is an
``madvise`` or ``brk`` call). On small or virtualized machines that costs more than the
decoding: receiving the transport benchmark's 2.8 MB messages over tcp, the receiving process
spent 1.6-1.7 times the CPU per message with glibc's adaptive defaults.

:func:`keep_freed_memory` fixes both of glibc's thresholds (``mallopt``): blocks under 32 MiB
come from the heap, and up to ``keep`` bytes of free memory at the top of each heap stay
mapped for the next allocations. The cost is resident memory: up to ``keep`` bytes per malloc
arena that a burst freed (glibc makes up to eight arenas per core, one per thread that
allocates concurrently). ``worldtap-store`` and ``worldtap-proxy`` call it at start and say
``malloc=keep`` in their ready line (``--malloc system`` keeps glibc's defaults); a process of
your own that subscribes to large messages may call it too. It is process-wide, so it is never
called on import or by :class:`~broker.Subscriber`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

__all__ = ["KEEP_FREED_BYTES", "MMAP_THRESHOLD", "apply_malloc_choice", "keep_freed_memory", "malloc_is_glibc"]

_log = logging.getLogger(__name__)

KEEP_FREED_BYTES = 64 << 20
"""Default free memory kept at the top of each heap (64 MiB: a few large messages)."""
MMAP_THRESHOLD = 32 << 20
"""Blocks of this size or more are mapped and unmapped on their own (glibc's largest allowed
value on 64-bit systems, the top of its adaptive range)."""

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def malloc_is_glibc() -> bool:
    """Whether this process allocates with glibc's malloc (Linux with glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):  # not glibc (musl has no such name)
        return False


def _user_set() -> str | None:
    """The environment setting through which the user already chose glibc's thresholds."""
    for name in _USER_SETTINGS:
        if name in os.environ:
            return name
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for key in ("glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold"):
        if key in tunables:
            return f"GLIBC_TUNABLES ({key})"
    return None


def keep_freed_memory(keep: int = KEEP_FREED_BYTES) -> bool:
    """Keep up to ``keep`` bytes of freed memory at the top of each heap, and take blocks under
    :data:`MMAP_THRESHOLD` from the heap, for the rest of this process (see the module's text).

    Returns whether the settings were made: ``False`` where the allocator is not glibc's, or
    where the environment already sets them (``MALLOC_TRIM_THRESHOLD_``,
    ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or ``GLIBC_TUNABLES``): the user's choice stands.

    Raises:
        ValueError: ``keep`` is negative or does not fit a C ``int``.
    """
    if not 0 <= keep < 2**31:
        raise ValueError(f"keep: expected 0 <= keep < 2**31 bytes, got {keep!r}")
    if not malloc_is_glibc():
        _log.debug("keep_freed_memory: the allocator is not glibc's malloc; nothing changed")
        return False
    chosen = _user_set()
    if chosen is not None:
        _log.debug("keep_freed_memory: %s is set; glibc's thresholds are left as it says", chosen)
        return False
    libc = ctypes.CDLL(None)
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, keep))
    if not done:
        _log.debug("keep_freed_memory: glibc refused mallopt; its defaults stay")
    return done


def apply_malloc_choice(choice: str) -> str:
    """Apply a command's ``--malloc`` choice (:func:`broker.cli_args.add_malloc_argument`):
    ``"keep"`` calls :func:`keep_freed_memory`, ``"system"`` changes nothing. Returns the
    setting in effect, for the command's ready line: ``"keep"`` where the settings were made,
    else ``"system"`` (glibc's defaults, or another allocator, or the environment's settings).

    Raises:
        ValueError: ``choice`` is neither ``"keep"`` nor ``"system"``.
    """
    if choice not in ("keep", "system"):
        raise ValueError(f"--malloc: expected 'keep' or 'system', got {choice!r}")
    return "keep" if choice == "keep" and keep_freed_memory() else "system"
