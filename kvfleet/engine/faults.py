"""Faults a test injects into one revision's engines: how a rollout test makes a "bad"
artifact without a bad model. Off unless `$KVFLEET_ENGINE_FAULTS` names the revision:

    KVFLEET_ENGINE_FAULTS="<revision prefix>:token_delay=0.3,error_rate=0.2;<prefix>:..."

`token_delay` (seconds) is added to every engine step after warm-up, so to every token of
every request, the first included (TTFT, TPOT and end-to-end latency grow; the requests stay
in flight, so a drain waits for them as for any slow request); `error_rate` (0-1) is the share
of requests answered 500 internal_error; `stall_after` (steps) makes the engine thread hang
after that many steps past warm-up, as a stuck kernel or a deadlock would (the watchdog's
case: probes fail, streams end with an error). The engine logs a warning at start when a fault
applies to it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULTS_ENV = "KVFLEET_ENGINE_FAULTS"


@dataclass(frozen=True)
class Faults:
    token_delay: float = 0.0
    error_rate: float = 0.0
    stall_after: float = 0.0  # steps; 0: never

    @property
    def active(self) -> bool:
        return self.token_delay > 0 or self.error_rate > 0 or self.stall_after > 0

    def fail_now(self) -> bool:
        return self.error_rate > 0 and random.random() < self.error_rate


def faults_for(spec: str, revision: str | None) -> Faults:
    """The faults `spec` (the env value) sets for `revision`; none when it names another.
    Raises ValueError naming the env var on a malformed value."""
    if not spec.strip() or not revision:
        return Faults()
    for entry in spec.split(";"):
        prefix, _, settings = entry.strip().partition(":")
        if not prefix or not revision.startswith(prefix.strip()):
            continue
        values: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in settings.split(","))):
            key, _, value = item.partition("=")
            if key not in ("token_delay", "error_rate", "stall_after"):
                raise ValueError(f"{FAULTS_ENV}: unknown fault {key!r} (token_delay, "
                                 "error_rate, stall_after)")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"{FAULTS_ENV}: {key}={value!r} is not a number") from None
        faults = Faults(**values)
        if faults.token_delay < 0 or not 0 <= faults.error_rate <= 1 or faults.stall_after < 0:
            raise ValueError(f"{FAULTS_ENV}: token_delay >= 0, 0 <= error_rate <= 1 and "
                             "stall_after >= 0")
        return faults
    return Faults()
