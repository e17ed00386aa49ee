"""An ASGI middleware that refuses request bodies over a size limit with 413 (OpenAI's error
body) before the app parses them. The body is read here (the API's bodies are read whole
anyway) and replayed to the app; later receive() calls (disconnect detection) go through.

A refused body is read on and discarded up to DISCARD_MAX bytes before the 413 is sent: a
server that answers and closes while the client is still sending makes the client's socket
reset, and the client then never sees the 413. Past DISCARD_MAX the connection is closed."""
from __future__ import annotations

import json

DISCARD_MAX = 64 << 20


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.refused = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            done = await _discard(receive, 0)
            return await self._refuse(send, int(declared), close=not done)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":          # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                done = not more or await _discard(receive, size)
                return await self._refuse(send, size, streamed=True, close=not done)
            if not more:
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int, streamed: bool = False, close: bool = False) -> None:
        self.refused += 1
        what = f"more than {self.max_bytes}" if streamed else f"{size}"
        message = (f"the request body has {what} bytes; this server accepts at most "
                   f"{self.max_bytes} (--max-request-bytes)")
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": "request_too_large"}}).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _discard(receive, size: int) -> bool:
    """Reads the rest of a refused body (up to DISCARD_MAX); True when all of it was read."""
    while size <= DISCARD_MAX:
        message = await receive()
        if message["type"] != "http.request":
            return False
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False
