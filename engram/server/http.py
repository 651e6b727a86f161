"""The HTTP layer's limits on slow clients, around uvicorn's h11 server.

A request's head must arrive within ``HttpLimits.request_headers`` seconds of connecting (or of the first
byte of the next request on a kept-alive connection), else 408 and close, so slowloris connections cannot
pile up; the body's deadline is app.py's ``BodyLimit``.
"""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True)
class HttpLimits:
    """Every timeout of the HTTP layer; ValueError naming the option for one that is not a positive number."""

    graceful_shutdown: float = 60.0  # seconds in-flight requests may take to finish after SIGTERM
    keep_alive: float = 5.0  # seconds an idle connection stays open between requests (uvicorn's default)
    request_headers: float = 10.0  # seconds a request's line and headers may take to arrive
    request_body: float = 30.0  # seconds a request's whole body may take to arrive, after its headers

    def __post_init__(self) -> None:
        for name, option in (("graceful_shutdown", "--timeout-graceful-shutdown"),
                             ("keep_alive", "--timeout-keep-alive"), ("request_headers", "--timeout-request-headers"),
                             ("request_body", "--timeout-request-body")):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{option}={value} must be a positive number of seconds")


def timed_h11(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's H11Protocol with the request-head deadline of ``limits``."""

    class HeadDeadlineProtocol(H11Protocol):
        head_timeout = limits.request_headers

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_head_timer()  # the first byte of the next request on a kept-alive connection
            super().data_received(data)
            if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
                self._cancel_head_timer()  # the head is complete: the body has its own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_expired)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                # h11 cannot send a response before a request: the 408 is written as bytes, then the socket closes
                self.transport.write(_REQUEST_TIMEOUT)
                self.transport.close()

    return HeadDeadlineProtocol


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` that calls ``on_shutdown()`` (on the event loop) when its graceful shutdown starts,
    so bodies still arriving get 503 rather than holding the process."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


def server_config(app, host: str, port: int, log_level: str, limits: HttpLimits) -> uvicorn.Config:
    """The uvicorn Config of `engram serve`: the h11 protocol with the head deadline, and uvicorn's own
    keep-alive and graceful-shutdown timeouts from ``limits``."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=timed_h11(limits),
                          timeout_keep_alive=limits.keep_alive, timeout_graceful_shutdown=limits.graceful_shutdown)


def check_port(host: str, port: int) -> None:
    """OSError when ``host``:``port`` cannot be bound, found by binding it once and letting it go. uvicorn binds
    it again itself: with a pre-bound socket, early replies (a 413 before the body is read) are lost more often."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
