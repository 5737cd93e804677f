"""The base of every Phoenix wire message (pure): frozen, no unknown field; the routed
kinds' common fields.  The kinds are ``messages.py`` (routed along the ring, the union,
parsing) and ``control_messages.py`` (one role to another).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ..phoenix.protocol import MAX_PRIORITY

__all__ = ["Cluster", "Finite", "Routed", "WireMessage"]

#: a measured value: finite, not negative
Finite = Annotated[float, Field(ge=0, allow_inf_nan=False)]
#: a cluster's id
Cluster = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class WireMessage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Routed(WireMessage):
    """A message routed along the ring to the owner of its event type."""

    event_type: str
    hops: list[str] = Field(default_factory=list)  # clusters visited, for hop counts
    priority: int = Field(0, ge=0, le=MAX_PRIORITY)  # set by the routing masters
    #: the message's own id (the client's or the entry router's): the type's owner routes
    #: one id once, so a message sent again over a detour is not matched twice
    id: str | None = Field(None, min_length=1, max_length=64)
    #: on a detour, the routing masters still to pass before the ring goes on as usual
    #: (each hop forwards to the first; docs/phoenix-ring-failures.md)
    via: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]] = Field(
        default_factory=list, max_length=64
    )
