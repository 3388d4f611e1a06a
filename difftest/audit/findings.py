"""The audit's output record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class Severity(str, Enum):
    ERROR = "error"  # changes what the serving draft computes
    BENIGN = "benign"  # a real difference, shown not to matter here (reason given)
    # a real difference the inputs cannot reach (a window longer than every row): never benign,
    # and it says what input would exercise it
    NOT_EXERCISED = "not_exercised"
    INFO = "info"


@dataclass
class Finding:
    check: str  # which audit produced it: ledger | vocab | config | capture
    cause: str  # a key of difftest.diagnosis.CAUSES
    severity: Severity
    message: str
    measured: dict = field(default_factory=dict)  # the size of the effect, where measured

    def as_dict(self) -> dict:
        d = asdict(self)
        d["severity"] = self.severity.value
        return d
