"""Cancel a request's handler as soon as its client goes away, streaming or not.

The body is read up front; afterwards the only thing the client can send is a disconnect, which
cancels the handler, and with it the engine call it is waiting on.
"""

from __future__ import annotations

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class CancelOnDisconnectMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body: list[Message] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body.append(message)
            if not message.get("more_body", False):
                break
        disconnected = anyio.Event()

        async def replay() -> Message:
            if body:
                return body.pop(0)
            await disconnected.wait()
            return {"type": "http.disconnect"}

        try:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    disconnected.set()
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                await self.app(scope, replay, send)
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:  # let the app's own error reach the error middleware as itself
                raise group.exceptions[0] from None
            raise
