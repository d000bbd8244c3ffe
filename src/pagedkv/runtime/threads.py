"""The thread policy of the OpenMP runtime that torch and the CPU kernels share.

By default an OpenMP worker spins for a while after each parallel region, waiting for the
next one. On a machine whose cores are shared (a laptop, a small VM, a server with other
processes) the spinning workers take the cores that the one doing the work needs, and
every step slows down; an inference engine alternates short parallel
regions with Python, which is the worst case. pagedkv therefore asks for
``OMP_WAIT_POLICY=PASSIVE`` (idle workers sleep) unless the user chose a policy.

The runtime reads the variable once, when it loads (with torch), so this runs when pagedkv
is imported, before torch. A user who sets ``OMP_WAIT_POLICY=ACTIVE`` says the cores are
the engine's own: the workers then spin, a parallel region starts at once, and the CPU
kernels split even a one-row product over every thread (`workers_spin`). Standard library
only.
"""

from __future__ import annotations

import os
import sys
import warnings

POLICY_ENV = "OMP_WAIT_POLICY"


def apply_thread_policy() -> None:
    """Default `OMP_WAIT_POLICY` to PASSIVE; warn when torch loaded the runtime first."""
    if POLICY_ENV in os.environ:
        return  # the user's choice
    os.environ[POLICY_ENV] = "PASSIVE"
    if sys.modules.get("torch") is not None:
        warnings.warn(
            "pagedkv: torch was imported before pagedkv, so its OpenMP runtime keeps busy-"
            "waiting threads, which slows steps down on a machine with other load; import "
            "pagedkv first or set OMP_WAIT_POLICY=PASSIVE before starting Python",
            RuntimeWarning,
            stacklevel=3,
        )


def workers_spin() -> bool:
    """Whether the OpenMP workers spin between parallel regions (the user's ACTIVE policy)."""
    return os.environ.get(POLICY_ENV, "").strip().upper() == "ACTIVE"
