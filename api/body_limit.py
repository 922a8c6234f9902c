"""ASGI middleware: request bodies over `max_bytes` (or a route's own limit, e.g. file
uploads) get 413, declared or streamed."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError, error_response


class BodyTooLarge(ApiError):
    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body is larger than the limit of {max_bytes} bytes")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, per_path: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = per_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.per_path.get(scope["path"], self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            response = error_response(413, str(BodyTooLarge(max_bytes).detail), path=scope["path"])
            await response(scope, receive, send)
            return

        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    # An HTTPException passes through FastAPI's body parsing to our handler.
                    raise BodyTooLarge(max_bytes)
            return message

        await self.app(scope, counting_receive, send)
