"""Seeds derived from a run seed and a variation key.

Kept free of torch and of the rest of the package (only ``hashlib``), so the derivation is the
same in every process, on every platform and in every Python version, and cheap to check.
"""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]

_U64 = 2**64
_PERSON = b"worldtap.seed"


def derive_seed(run_seed: int, key: str) -> int:
    """The seed of variation ``key`` in a run seeded ``run_seed``, in ``[0, 2**64)``.

    A BLAKE2b hash of the key's UTF-8 bytes keyed with the run seed: stable across processes
    (unlike ``hash()``, which is salted per process), and different keys or run seeds give
    unrelated seeds.

    Raises:
        VariationError: ``run_seed`` is not an int in ``[0, 2**64)`` or ``key`` is not a str.
    """
    if isinstance(run_seed, bool) or not isinstance(run_seed, int) or not 0 <= run_seed < _U64:
        raise _error(f"run_seed: expected an int in [0, 2**64), got {run_seed!r}")
    if not isinstance(key, str):
        raise _error(f"key: expected a str, got {key!r}")
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8, key=run_seed.to_bytes(8, "little"),
                             person=_PERSON).digest()
    return int.from_bytes(digest, "little")


def _error(message: str) -> Exception:
    from ..errors import VariationError  # imported on the error path only (it imports torch)

    return VariationError(message)
