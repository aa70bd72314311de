"""`StopCutter`: OpenAI's `stop` strings applied to text the model streams (the SDK has no `stop`
setting; the server cuts the text and then cancels the generation).

A stop string may straddle two chunks, so the cutter holds back the last `len(longest stop) - 1`
characters until the next chunk shows whether they start a stop. The text before the first stop
is what the client gets; the stop itself is never sent (OpenAI's behaviour).
"""

from __future__ import annotations


class StopCutter:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, chunk: str) -> str:
        """The text that can be sent now; after a stop was found, '' (and `stopped` is True)."""
        if self.stopped:
            return ""
        self.pending += chunk
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        if not self.hold:
            out, self.pending = self.pending, ""
            return out
        out, self.pending = self.pending[: -self.hold], self.pending[-self.hold :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
