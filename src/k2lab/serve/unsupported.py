"""OpenAI request fields k2lab serve does not implement: taken at their defaults only, anything else refused
with 400 naming the field ("k2lab serve does not support <field>..."), never silently ignored. Chat and
``/v1/completions`` share the sampling ones (``UnimplementedSampling``: ``frequency_penalty`` /
``presence_penalty`` 0 or null, ``logit_bias`` {} or null) and ``refuse_unsupported``."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, StrictFloat

from k2lab.serve.errors import APIError

__all__ = ["Refusals", "UnimplementedSampling", "refuse_unsupported"]

Refusals = dict[str, tuple[bool, str]]  # field -> (set to a value k2lab cannot honour, what follows its name)


class UnimplementedSampling(BaseModel):
    """The sampling fields of OpenAI's chat and completion requests that k2lab's sampler has no term for."""

    frequency_penalty: StrictFloat | None = 0.0
    presence_penalty: StrictFloat | None = 0.0
    logit_bias: dict[str, StrictFloat] | None = None

    def sampling_refusals(self) -> Refusals:
        return {
            "frequency_penalty": (self.frequency_penalty not in (None, 0), " other than 0"),
            "presence_penalty": (self.presence_penalty not in (None, 0), " other than 0"),
            "logit_bias": (bool(self.logit_bias), ""),
        }


def refuse_unsupported(refusals: Mapping[str, tuple[bool, str]]) -> None:
    """Raise 400 (``APIError``, ``param`` the field) for the first field of ``refusals`` that is set."""
    for field, (refuse, detail) in refusals.items():
        if refuse:
            message = f"k2lab serve does not support {field}{detail}."
            raise APIError(400, message, "invalid_request_error", field)
