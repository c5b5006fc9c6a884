"""Admin answers that a person reads in a terminal: indented JSON for ``curl``, ``Wget`` and ``HTTPie``.

Programs (the ``openai`` client, the evaluation job, browsers' fetch) get FastAPI's compact JSON unchanged; a
command-line client, recognised by its ``User-Agent``, gets the same JSON indented by two spaces with a final
newline, so ``curl -s .../admin/active`` prints readably without ``| python -m json.tool``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response

from service.api.body import JSONBodyRoute

#: ``User-Agent`` prefixes of command-line HTTP clients (curl/8.5.0, Wget/1.21, HTTPie/3.2.2), lower case.
TERMINAL_CLIENTS = ("curl/", "wget/", "httpie/")


def is_terminal_client(request: Request) -> bool:
    """True when the request comes from a command-line HTTP client (by its ``User-Agent``)."""
    return request.headers.get("user-agent", "").lower().startswith(TERMINAL_CLIENTS)


def indented(response: Response) -> Response:
    """The same JSON response with its body indented (status and headers kept, length recomputed)."""
    body = json.dumps(json.loads(response.body), indent=2, ensure_ascii=False) + "\n"
    headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
    return Response(body, status_code=response.status_code, headers=headers, media_type="application/json")


class ReadableJSONRoute(JSONBodyRoute):
    """A route whose JSON answers are indented for command-line clients (`is_terminal_client`); its JSON body is
    read as every route's is (`service.api.body.JSONBodyRoute`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            response = await handler(request)
            if is_terminal_client(request) and response.media_type == "application/json" and response.body:
                return indented(response)
            return response

        return route
