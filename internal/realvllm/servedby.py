"""ASGI middleware that names the answering server in every response.

Loaded with `vllm serve --middleware servedby.ServedBy`; the value comes from
SWITCHYARD_SERVED_BY (the tests set it to the server's host:port), so a test
reading a response through Envoy knows which model server produced it. The
project's simulator sends the same header.
"""

import os


class ServedBy:
    def __init__(self, app):
        self.app = app
        self.value = os.environ.get("SWITCHYARD_SERVED_BY", "").encode()

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or not self.value:
            await self.app(scope, receive, send)
            return

        async def send_with_header(message):
            if message.get("type") == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-served-by", self.value))
                message = dict(message, headers=headers)
            await send(message)

        await self.app(scope, receive, send_with_header)
