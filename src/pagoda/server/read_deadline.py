"""A deadline on reading each request: slow clients cannot hold connections open.

uvicorn closes a keep-alive connection that sits idle between requests, but nothing else: a connection that
sends nothing, or trickles its headers or body a byte at a time, is held for as long as the client likes, and
a few hundred of them hold a few hundred sockets and file descriptors. Here uvicorn's h11 protocol is
given one deadline per request: from the connection's opening (or the first byte of a later request on it)
to the end of the request's body. A connection that has sent nothing of its request by then is closed; one
that has sent part of its headers gets a 408 first; one whose body is still arriving is closed, and the app,
reading it, sees the client gone. Requests whose bodies have arrived are never affected, however long their
responses take.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagoda.wire import OpenAIError

logger = logging.getLogger(__name__)

_TIMED_OUT_BODY = json.dumps(OpenAIError(408, "the request did not arrive in time").body()).encode()
REQUEST_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                            b"content-length: %d\r\n\r\n%s" % (len(_TIMED_OUT_BODY), _TIMED_OUT_BODY))
# h11 states in which the client is still sending the request: before its headers end, and during its body.
_RECEIVING = (h11.IDLE, h11.SEND_BODY)


class ReadDeadlineProtocol(H11Protocol):
    """H11Protocol with a deadline on reading each request (`read_timeout` seconds; see the module)."""

    read_timeout: float = 10.0  # set by read_deadline_protocol()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._follow_request()

    def _follow_request(self) -> None:
        """Armed while a request is arriving (its headers begun, or its body not yet all in); disarmed once it
        has arrived. Between requests, uvicorn's keep-alive timeout governs an idle connection."""
        state = self.conn.their_state
        if state is h11.SEND_BODY or (state is h11.IDLE and self.conn.trailing_data[0]):
            if self._read_deadline is None:
                self._arm()
        elif state not in _RECEIVING:
            self._disarm()

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout, self._on_read_timeout)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _on_read_timeout(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing() or self.conn.their_state not in _RECEIVING:
            return
        started_request = self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]
        if started_request:  # no response can have begun: the app has not seen this request
            self.transport.write(REQUEST_TIMEOUT_RESPONSE)
        logger.debug("closing a connection whose request did not arrive within %.0f s", self.read_timeout)
        self.transport.close()


def read_deadline_protocol(read_timeout: float) -> type[ReadDeadlineProtocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline."""
    return type("ReadDeadlineProtocol", (ReadDeadlineProtocol,), {"read_timeout": read_timeout})
