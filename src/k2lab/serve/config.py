"""``k2lab serve``'s settings: where to listen, what to call the model, how many sequences decode together,
how much memory the automatic prefix cache may hold, whether to decode speculatively."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from k2lab.hardware import Precision
from k2lab.infer.compiled import CompileMode
from k2lab.infer.decode_weights import decode_weights_field
from k2lab.infer.speculative import DRAFT_TOKENS

__all__ = ["DEFAULT_MAX_TOKENS", "ServeConfig"]

#: A chat request's completion budget when it sets neither max_tokens nor max_completion_tokens (cut to what
#: the context leaves after its prompt).
DEFAULT_MAX_TOKENS = 256


class ServeConfig(BaseModel):
    """The OpenAI-compatible server (the API key is not here: it comes from a flag or ``$K2LAB_API_KEY``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", description="Interface to bind (loopback by default).")
    port: int = Field(default=8000, ge=0, lt=65536, description="TCP port (0: a free one, printed).")
    model_name: str | None = Field(
        default=None, description="Model id clients ask for (None: the directory name)."
    )
    max_batch: int = Field(default=16, ge=1, description="Sequences decoded together (continuous batching).")
    max_context: int | None = Field(
        default=None,
        ge=2,
        description="Prompt + completion limit (None: the model's). A chat request without max_tokens may "
        f"generate {DEFAULT_MAX_TOKENS} tokens, fewer where its prompt leaves less room.",
    )
    prefix_cache_mb: int = Field(
        default=256,
        ge=0,
        description="Automatic prefix cache cap in MiB: shared prompt blocks prefill once (0: off).",
    )
    prefix_block_size: int = Field(default=16, ge=1, description="Tokens per prefix-cache block.")
    compile: CompileMode = Field(
        default="auto",
        description="torch.compile the decode step (k2lab.infer.compiled): auto = on for CUDA; on a CPU, "
        "eager until a background thread has built it, then compiled (k2lab.serve.background_compile: "
        "~2 min for batch sizes 1-16 from an empty inductor cache on 2 cores; k2-mini then served 1.5-3.8x "
        "faster); "
        "on = compiled from the first step (requests wait for the build), off = eager.",
    )
    decode_weights: Precision = decode_weights_field()
    speculative: bool | None = Field(
        default=None,
        description="Speculative decoding with the draft beside the model (MODEL/draft/ or its MTP layer): "
        "None = on when one is found, unless the decode step runs compiled on a CPU (plain compiled decoding "
        "is faster there), and then on a CPU only for greedy requests (sampled ones decode plainly: sampled "
        "speculation measured slower there), True = required for every request, False = off.",
    )
    draft_tokens: int = Field(
        default=DRAFT_TOKENS, ge=1, description="Tokens the draft proposes per verify step (k)."
    )
