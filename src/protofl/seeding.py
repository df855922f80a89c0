"""Named random streams: every random choice of a run derives from the experiment seed here.

A stream is a path ``(seed, stream, *keys)`` hashed by NumPy's :class:`~numpy.random.SeedSequence`
into a 63-bit seed; different paths give independent streams, and the same path the same
stream on every engine (the in-process simulator, the batched executor, Flower).  The numbers
are part of a run's identity: changing one changes every result drawn from it, so new streams
take new numbers and old ones are never renumbered.

=================  ==========================================================================
stream             what draws from it (keys after the stream number)
=================  ==========================================================================
``DATA``           partitions, allocations and subsampling of the data (none)
``INIT``           the client models' initial weights (none: all clients start equal)
``TRAIN``          a client's batch order (client id)
``NOISE``          a *derived* noise key (client id; see :mod:`protofl.privacy.noise`)
``SERVER``         participant sampling and dropout (none)
``DIAGNOSTICS``    local-only diagnostics such as the membership-inference probe (client, round)
``LOCAL_RNG``      torch's global generator forked during local training (client, round)
``AUDIT``          the privacy audit's trials (mechanism tag, trial)
=================  ==========================================================================

Methods with server-side randomness (FedTGP's generator, MPFT's server head) derive it with
:func:`method_generator` from the experiment seed, so seeds reach them too.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

__all__ = ["DATA_TAG", "Stream", "derive_seed", "generator", "method_generator"]


class Stream(IntEnum):
    """The engine's random streams (the second element of a seed path)."""

    INIT = 1
    TRAIN = 2
    NOISE = 3
    SERVER = 4
    DIAGNOSTICS = 5
    LOCAL_RNG = 6
    AUDIT = 7
    EVAL = 8
    DATA = 0xDA7A


DATA_TAG = int(Stream.DATA)
"""The data stream's key, as NumPy's ``SeedSequence([seed, DATA_TAG])`` uses it."""


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed derived from the experiment seed and a path of integer keys."""
    return int(
        np.random.SeedSequence([int(seed), *(int(k) for k in keys)])
        .generate_state(2, dtype=np.uint32)
        .view(np.uint64)[0]
        >> 1
    )


def generator(seed: int, stream: Stream, *keys: int) -> torch.Generator:
    """A torch generator for ``stream`` (and ``keys``) of the experiment ``seed``."""
    return torch.Generator().manual_seed(derive_seed(seed, int(stream), *keys))


def method_generator(*keys: int) -> torch.Generator:
    """A torch generator seeded from a method's own path of keys, which starts with the
    experiment seed (no global RNG)."""
    return torch.Generator().manual_seed(derive_seed(*keys))
