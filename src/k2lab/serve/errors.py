"""The error every endpoint of ``k2lab serve`` answers with: a status and OpenAI's body
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

__all__ = ["APIError", "check_model", "check_unicode", "error_body"]


def error_body(status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
    """The JSON response of one error."""
    error = {"message": message, "type": kind, "param": param, "code": code}
    return JSONResponse(status_code=status, content={"error": error})


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's body (``kind`` is its ``type``: by default
    ``invalid_request_error`` below 500, ``internal_server_error`` from 500)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        kind = kind or ("invalid_request_error" if status < 500 else "internal_server_error")
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        return error_body(self.status, self.message, self.kind, self.param, self.code)


def check_model(served: str, asked: str | None) -> None:
    """404 ``model_not_found`` when a request names a model other than the one served (None: any)."""
    if asked is not None and asked != served:
        raise APIError(404, f"The model '{asked}' does not exist; this server serves '{served}'.",
                       param="model", code="model_not_found")  # fmt: skip


def check_unicode(text: str, param: str) -> None:
    """400 for text the tokenizer cannot take: a lone UTF-16 surrogate (JSON's ``"\\ud800"`` unpaired) is a
    Python ``str`` but no Unicode text, and would fail inside the tokenizer as a 500."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start : error.end].encode("utf-8", "backslashreplace").decode()
        raise APIError(
            400, f"Text in {param} contains {bad}, a lone surrogate, which is not valid Unicode.", param=param
        ) from None
