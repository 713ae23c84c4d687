"""CheckpointPolicy and the rule that picks one for a named op.

Both modes (eager tape and compiler) obey the same precedence: a region's name
globs (``save=`` / ``recompute=`` / ``offload=``) win over the policy written at
the call site, which wins over the default, RECOMPUTE.
"""
from __future__ import annotations

import enum
from typing import Optional

from remat_fx.naming import NameGlobs


class CheckpointPolicy(enum.Enum):
    """What happens to a named op's activations between forward and backward."""

    RECOMPUTE = "recompute"  # rerun the op during recompute; save nothing for it
    SAVE = "save"  # keep what its backward needs on the tape; skip it in recompute
    OFFLOAD = "offload"  # like SAVE, but the tape holds it through an offloader

    @property
    def skips_recompute(self) -> bool:
        return self is not CheckpointPolicy.RECOMPUTE

    def __repr__(self) -> str:  # CheckpointPolicy.SAVE, not <CheckpointPolicy.SAVE: 'save'>
        return f"CheckpointPolicy.{self.name}"


def coerce_policy(policy, *, what: str) -> Optional[CheckpointPolicy]:
    """Accept a CheckpointPolicy, its name ("save", "SAVE") or None."""
    if policy is None or isinstance(policy, CheckpointPolicy):
        return policy
    if isinstance(policy, str):
        try:
            return CheckpointPolicy[policy.upper()]
        except KeyError:
            pass
    valid = ", ".join(f"CheckpointPolicy.{p.name}" for p in CheckpointPolicy)
    raise ValueError(f"{what}: policy {policy!r} is not one of {valid}")


def resolve_policy(name: str, written: Optional[CheckpointPolicy], globs: Optional[NameGlobs]) -> CheckpointPolicy:
    """The policy a named op runs with: region globs > call site > RECOMPUTE."""
    if globs is not None:
        chosen = globs.match(name)
        if chosen is not None:
            return CheckpointPolicy[chosen]
    return written if written is not None else CheckpointPolicy.RECOMPUTE
