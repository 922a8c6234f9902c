"""ASGI middleware: request bodies over `max_bytes` get 413, declared or streamed."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError, error_response


class BodyTooLarge(ApiError):
    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body is larger than the limit of {max_bytes} bytes")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(413, str(BodyTooLarge(self.max_bytes).detail))(scope, receive, send)
            return

        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # An HTTPException passes through FastAPI's body parsing to our handler.
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)
