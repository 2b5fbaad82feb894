"""Faults a test injects into one revision's engines: how a rollout test makes a "bad"
artifact without a bad model. Off unless `$KVFLEET_ENGINE_FAULTS` names the revision:

    KVFLEET_ENGINE_FAULTS="<revision prefix>:token_delay=0.3,error_rate=0.2;<prefix>:..."

`token_delay` (seconds) is added to every engine step after warm-up, so to every token of
every request, the first included (TTFT, TPOT and end-to-end latency grow; the requests stay
in flight, so a drain waits for them as for any slow request); `error_rate` (0-1) is the share
of requests answered 500 internal_error; `stall_after` (steps) makes the engine thread hang
after that many steps past warm-up, as a stuck kernel or a deadlock would (the watchdog's
case: probes fail, streams end with an error); `stream_error_rate` (0-1) is the share of
streamed requests that end, after their first tokens, with `finish_reason: "error"` under their
HTTP 200, as an engine step that throws ends them; `long_prompt_delay` (seconds per prompt
token) is waited before a request whose prompt is over `long_prompt_tokens` (default 1024)
starts, for each token over it: a revision slow on long prompts only; `exit_after` (seconds)
ends the engine process with exit code 1 that long after it is ready, as a crash or an OOM
kill minutes into serving would (its container restarts). The engine logs a warning at start
when a fault applies to it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULTS_ENV = "KVFLEET_ENGINE_FAULTS"
KNOWN = ("token_delay", "error_rate", "stall_after", "stream_error_rate", "long_prompt_delay",
         "long_prompt_tokens", "exit_after")


@dataclass(frozen=True)
class Faults:
    token_delay: float = 0.0
    error_rate: float = 0.0
    stall_after: float = 0.0  # steps; 0: never
    stream_error_rate: float = 0.0
    long_prompt_delay: float = 0.0  # seconds per prompt token over long_prompt_tokens
    long_prompt_tokens: float = 1024.0
    exit_after: float = 0.0  # seconds after ready; 0: never

    @property
    def active(self) -> bool:
        return (self.token_delay > 0 or self.error_rate > 0 or self.stall_after > 0
                or self.stream_error_rate > 0 or self.long_prompt_delay > 0
                or self.exit_after > 0)

    def fail_now(self) -> bool:
        return self.error_rate > 0 and random.random() < self.error_rate

    def fail_stream_now(self) -> bool:
        return self.stream_error_rate > 0 and random.random() < self.stream_error_rate

    def prompt_delay(self, prompt_tokens: int) -> float:
        """Seconds to wait before a prompt of `prompt_tokens` starts."""
        return max(0.0, prompt_tokens - self.long_prompt_tokens) * self.long_prompt_delay


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
            if key not in KNOWN:
                raise ValueError(f"{FAULTS_ENV}: unknown fault {key!r} ({', '.join(KNOWN)})")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"{FAULTS_ENV}: {key}={value!r} is not a number") from None
        faults = Faults(**values)
        if min(faults.token_delay, faults.stall_after, faults.long_prompt_delay,
               faults.long_prompt_tokens, faults.exit_after) < 0 or not (
                0 <= faults.error_rate <= 1 and 0 <= faults.stream_error_rate <= 1):
            raise ValueError(f"{FAULTS_ENV}: rates are 0-1, the other faults >= 0")
        return faults
    return Faults()
