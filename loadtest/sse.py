"""Server-sent events: bytes as they arrive -> the data of each complete event. Pure: no I/O.

The framing of the WHATWG HTML standard's event-stream (the one OpenAI's streaming uses):

    data: {"id": ...}\\n          a field line: name, ':', an optional space, the value
    data: more\\n                 several data lines of one event are joined with '\\n'
    : keep-alive\\n               a comment (no name before the ':'): ignored
    \\n                           a blank line ends the event; an event without data is dropped

Lines end with \\n, \\r\\n or \\r, and a network read may stop anywhere, inside a line or between
the \\r and \\n of one line ending; a UTF-8 character split across reads is joined before decoding.
Fields other than data (event, id, retry) are read and ignored: OpenAI's stream sends none.
"""

from __future__ import annotations


class SSEDecoder:
    def __init__(self) -> None:
        self._pending = b""  # the start of a line whose end has not arrived
        self._skip_lf = False  # the last read ended with \r: a \n that opens the next is its ending
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event that chunk completes, in order."""
        if not chunk:
            return []
        if self._skip_lf and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._skip_lf = chunk.endswith(b"\r")
        lines = (self._pending + chunk).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self._pending = lines.pop()
        events = []
        for line in lines:
            event = self._line(line.decode("utf-8"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[str]:
        """At the end of the stream: an event the server ended without its blank line."""
        events = self.feed(b"\n") if self._pending else []
        tail = self._line("")
        return [*events, *([tail] if tail is not None else [])]

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        name, colon, value = line.partition(":")
        if colon and not name:
            return None  # a comment
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None
