"""The server's error answer (OpenAI's error body) and the one field reader every request parser uses: a wrong
field is a 400 naming it and what was expected."""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

__all__ = ["ApiError", "get_field"]


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, type_: str = "invalid_request_error",
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def get_field(body: dict, name: str, kinds, default, check=None, what: str = ""):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise ApiError(400, f"'{name}' must be {what or kinds[0].__name__}, got a boolean", name)
    if not isinstance(v, kinds):
        raise ApiError(400, f"'{name}' must be {what or kinds[0].__name__}, got {type(v).__name__}", name)
    if check is not None and not check(v):
        raise ApiError(400, f"'{name}' must be {what}, got {v!r}", name)
    return v
