"""Which rank of a tensor-parallel launch this process is, from the launcher's environment.
Apart from speccli.backends.distributed (which imports torch) so that a command can ask
before it has loaded anything."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Rank:
    """This process's place: rank `index` of `size`, `local` on its node."""

    index: int
    size: int
    local: int

    @property
    def leads(self) -> bool:
        return self.index == 0


def current() -> Rank:
    """This process's rank from the launcher's environment (rank 0 of 1 outside one)."""
    env = os.environ
    return Rank(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def launched() -> bool:
    """Whether this process was started by torchrun or specgen's own launch."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ
