"""Stop strings, applied once and incrementally: the serving path (async_engine) and the
offline `LLM.generate` both use `StopStrings`."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """A request's output text with its stop strings applied as it grows.

    `feed` takes the next decoded piece and returns what may be shown now: the text up to the
    first stop string (which sets `hit`; nothing after it is ever shown), and, before the end,
    never a tail that begins one ("ST" is held back under the stop "STOP", "SX" is not). Each
    piece is searched only where a match could begin (from `len(longest) - 1` characters before
    it), so a step costs the piece's length, not the whole output's.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self._longest = max(map(len, self.stop), default=0)
        self.text = ""
        self.hit = False
        self._shown = 0

    def feed(self, piece: str, final: bool = False) -> str:
        if self.hit:
            return ""
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.text, self.hit, visible = self.text[:cut], True, cut
        elif final or not self.stop:
            visible = len(self.text)
        else:
            visible = max(self._shown, len(self.text) - self._held())
        delta = self.text[self._shown:visible]
        self._shown = max(self._shown, visible)
        return delta

    def _held(self) -> int:
        """The length of the longest tail of the text that begins some stop string."""
        for n in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
