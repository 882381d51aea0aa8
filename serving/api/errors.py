"""OpenAI-style errors: every failure a client can see is one of these, never a traceback."""

from __future__ import annotations

from aiohttp import web


class APIError(Exception):
    """An error with the HTTP status and the OpenAI error body fields it maps to."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _default_type(status)
        self.headers = headers or {}

    def to_response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers=self.headers)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    if status == 503:
        return "server_overloaded"
    if status >= 500:
        return "internal_server_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)
