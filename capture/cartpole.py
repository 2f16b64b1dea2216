"""Per-world physical parameters for gymnasium's ``CartPoleVectorEnv``.

``CartPoleVectorEnv`` steps every world at once in numpy, reading its physical parameters
(``length`` (half the pole's length), ``masspole``, ``masscart``, ``force_mag``, and the derived
``polemass_length = masspole * length`` and ``total_mass = masspole + masscart``) in every
``step`` in element-wise expressions over the worlds; when they are arrays of shape
``(num_envs,)`` each world steps with its own values. Its ``reset`` draws the state only, so
parameters written before a world's first step of an episode are the ones that episode uses.
(Its ``render`` draws one pole length for every world; rendering is not supported with
per-world parameters.)

:class:`CartPoleRandomizer` turns those parameters into per-world arrays and redraws the chosen
ones from :class:`capture.variations.Variation` samplers for the worlds it is called with; use it
as an ``on_reset`` callback of :class:`capture.gymnasium.RecordingVectorEnv`, which calls it
before each world's first step of each episode. :func:`physics` reads what the environment
uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from broker.messages import BUILD

from .variations.variation import Variation

__all__ = ["DERIVED", "PARAMETERS", "CartPoleRandomizer", "physics"]

PARAMETERS = ("length", "masspole", "masscart", "force_mag")
"""The parameters a :class:`CartPoleRandomizer` can randomize."""
DERIVED = ("polemass_length", "total_mass")
"""Parameters computed from the others (kept consistent by the randomizer)."""


def _cartpole(env: Any) -> Any:
    """The ``CartPoleVectorEnv`` under ``env`` (``env.unwrapped``)."""
    base = getattr(env, "unwrapped", env)
    missing = [p for p in (*PARAMETERS, *DERIVED, "num_envs", "state") if not hasattr(base, p)]
    if missing:
        raise TypeError(f"env: expected gymnasium's CartPoleVectorEnv (or a wrapper of one), got "
                        f"{type(base).__name__} without {missing}")
    return base


def physics(env: Any) -> dict[str, np.ndarray]:
    """The physical parameters ``env`` steps with, one float64 value per world (copies).

    Keys: :data:`PARAMETERS`, :data:`DERIVED` and ``gravity``.
    """
    base = _cartpole(env)
    n = base.num_envs
    return {name: np.broadcast_to(np.asarray(getattr(base, name), np.float64), (n,)).copy()
            for name in (*PARAMETERS, *DERIVED, "gravity")}


class CartPoleRandomizer:
    """Draws chosen physical parameters of a ``CartPoleVectorEnv``'s worlds from variations.

    On construction every parameter of :data:`PARAMETERS` and :data:`DERIVED` becomes a float64
    array of shape ``(num_envs,)`` holding its current value (numerically the same dynamics).
    Each call ``randomizer(worlds)`` draws every runtime variation once for ``worlds``
    (``variation.sample(len(worlds), worlds)``, so attached listeners such as a
    ``VariationRecorder`` see the draw with those worlds) and writes the values into the
    environment's arrays at those worlds, then recomputes ``polemass_length`` and
    ``total_mass``. Build-phase variations are drawn only at the first call that includes a
    world (their value holds for the whole run).

    Example::

        env = gymnasium.make_vec("CartPole-v1", num_envs=64, vectorization_mode="vector_entry_point")
        recorder = Recorder(64, broker=broker)
        variations = {"length": Variation("length", VariationCfg(sampler=UniformCfg(0.25, 1.0))),
                      "force_mag": Variation("force_mag", VariationCfg(sampler=UniformCfg(5.0, 15.0)))}
        VariationRecorder(recorder).attach(variations.values())  # before the first draw
        env = RecordingVectorEnv(env, recorder, on_reset=[CartPoleRandomizer(env, variations)])

    Args:
        env: A ``CartPoleVectorEnv`` or a wrapper of one.
        variations: Parameter name (one of :data:`PARAMETERS`) -> a variation with per-world
            shape ``()``.

    Raises:
        TypeError: ``env`` is not a CartPoleVectorEnv, or a value is not a Variation.
        ValueError: An unknown parameter, or a variation whose per-world shape is not ``()``.
    """

    def __init__(self, env: Any, variations: Mapping[str, Variation]) -> None:
        self.env = _cartpole(env)
        for name, variation in variations.items():
            if name not in PARAMETERS:
                raise ValueError(f"variations: expected parameters among {list(PARAMETERS)}, got {name!r}")
            if not isinstance(variation, Variation):
                raise TypeError(f"variations[{name!r}]: expected a Variation, got {type(variation).__name__}")
            if tuple(variation.sampler.shape) != ():
                raise ValueError(f"variations[{name!r}]: expected per-world shape (), got "
                                 f"{tuple(variation.sampler.shape)}")
        self.variations = dict(variations)
        n = self.num_envs = int(self.env.num_envs)
        for name in (*PARAMETERS, *DERIVED):
            setattr(self.env, name, np.broadcast_to(np.asarray(getattr(self.env, name), np.float64), (n,)).copy())
        self._built = np.zeros(n, np.bool_)

    def __call__(self, worlds: torch.Tensor) -> None:
        """Draw the variations for ``worlds`` (1-D int64 indices) and apply them."""
        index = worlds.detach().cpu().numpy()
        if index.ndim != 1 or index.dtype.kind not in "iu" or (
                len(index) and (index.min() < 0 or index.max() >= self.num_envs)):
            raise ValueError(f"worlds: expected a 1-D integer index of worlds below {self.num_envs}, "
                             f"got {worlds!r}")
        if not len(index):
            return
        fresh = index[~self._built[index]]
        for name, variation in self.variations.items():
            chosen = fresh if variation.phase == BUILD else index
            if not len(chosen):
                continue
            selector = worlds if len(chosen) == len(index) else torch.from_numpy(chosen).to(worlds.device)
            value = variation.sample(len(chosen), selector)
            getattr(self.env, name)[chosen] = value.detach().cpu().numpy().astype(np.float64)
        self._built[index] = True
        env = self.env
        env.polemass_length = env.masspole * env.length
        env.total_mass = env.masspole + env.masscart

    def __repr__(self) -> str:
        return f"CartPoleRandomizer(num_envs={self.num_envs}, variations={sorted(self.variations)})"
