"""The error every endpoint of ``k2lab serve`` answers with: a status and OpenAI's body
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from k2lab.data.tokenizer import refuse_surrogates
from k2lab.errors import K2LabError

__all__ = ["APIError", "check_model", "check_unicode", "error_body", "parse_body"]

Body = TypeVar("Body", bound=BaseModel)


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
    Python ``str`` but no Unicode text (``refuse_surrogates``)."""
    try:
        refuse_surrogates(text, f"Text in {param}")
    except K2LabError as error:
        raise APIError(400, f"{error}.", param=param) from None


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The request's JSON object as ``model``, whatever its Content-Type (as OpenAI's server takes it); 400
    for a body that is not JSON (or nested too deeply to parse), not an object, or not valid for ``model``."""
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"The request body is not valid JSON ({error}).") from error
    except RecursionError as error:  # json's parser refuses nesting past the interpreter's recursion limit
        raise APIError(400, "The request body nests objects and arrays too deeply to parse.") from error
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        message, param = _validation_message(error)
        raise APIError(400, message, param=param) from error


def _validation_message(error: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a request's first validation error; param is the field's path (``messages.0.role``)
    without pydantic's tags for the member of a union it tried (``tool_choice.literal[...]``, ``stop.str``)."""
    first = error.errors()[0]
    parts = [part for part in first.get("loc", ()) if part != "body" and not _union_tag(part)]
    location = ".".join(str(part) for part in parts)
    return f"{location or 'body'}: {first.get('msg', 'invalid value')}", location or None


def _union_tag(part: object) -> bool:
    """Whether a location part names a union member's type (``str``, ``list[str]``, ``literal['a','b']``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part)
