"""The named confirm modes, and what each one asks of the broker and the consumers."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ..transport.topology import QueueKind

__all__ = ["ConfirmMode", "ModeProfile"]


class ConfirmMode(StrEnum):
    """How a publish is confirmed; comparable on the same load (``qosmq bench confirms``)."""

    NONE = "none"  # fire and forget
    BROKER = "broker"  # broker publisher confirms, transient messages, classic queues
    PERSISTENT = "persistent"  # confirms + quorum queues + delivery mode 2: the paper's baseline
    E2E = "e2e"  # transient messages; confirmed by every expected consumer's receipt
    E2E_PERSISTENT = "e2e-persistent"  # receipts, over persistent messages on quorum queues

    @property
    def profile(self) -> ModeProfile:
        return _PROFILES[self]


@dataclass(frozen=True, slots=True)
class ModeProfile:
    queue_kind: QueueKind
    persistent: bool
    broker_confirm: bool
    receipts: bool


_PROFILES = {
    ConfirmMode.NONE: ModeProfile(QueueKind.CLASSIC, False, False, False),
    ConfirmMode.BROKER: ModeProfile(QueueKind.CLASSIC, False, True, False),
    ConfirmMode.PERSISTENT: ModeProfile(QueueKind.QUORUM, True, True, False),
    # e2e needs no broker confirm: the receipts say more, and skipping it is the paper's gain
    ConfirmMode.E2E: ModeProfile(QueueKind.CLASSIC, False, False, True),
    ConfirmMode.E2E_PERSISTENT: ModeProfile(QueueKind.QUORUM, True, False, True),
}
