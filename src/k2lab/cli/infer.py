"""Inference commands: ``generate`` (speculative with a draft), ``serve`` (OpenAI-compatible) and
``draft train`` (an EAGLE-style draft beside a model)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from k2lab.cli.app import app, console
from k2lab.cli.options import Opt, runs_config
from k2lab.errors import K2LabError
from k2lab.infer.generate import GenerationConfig
from k2lab.infer.speculative import DRAFT_TOKENS
from k2lab.interrupt import reports_interrupt
from k2lab.serve.config import ServeConfig
from k2lab.train.draft_config import DraftTrainConfig

draft_app = typer.Typer(
    help="Drafts for speculative decoding (EAGLE-style, on the model's MTP layer).", no_args_is_help=True
)
app.add_typer(draft_app, name="draft")


def parse_token_ids(text: str, why: str = "this checkpoint has no tokenizer.json") -> list[int]:
    """'1 2 3' or '1,2,3' -> [1, 2, 3] (the prompts of a checkpoint without a tokenizer.json, or of
    --token-ids: ``why`` says which in the error)."""
    parts = [part for part in re.split(r"[\s,]+", text.strip()) if part]
    if not parts or not all(part.isdigit() for part in parts):
        raise K2LabError(
            f"{why}, so --prompt must be token ids separated by spaces or commas (e.g. '1 2 3'), got {text!r}"
        )
    return [int(part) for part in parts]


def _image_prompts(model, tokenizer, images: list[Path], texts: list[str]):
    """Token ids (image placeholders + text) and pixel inputs for ``generate --image``.

    The images stay open (not yet decoded) until the processor has them: it converts them (transparency
    onto white, 16-bit gray to 8 bits) and shrinks a large one in PIL before decoding it in full.
    """
    from PIL import Image, UnidentifiedImageError

    from k2lab.vision.mixture import image_prompts
    from k2lab.vision.vlm import VisionLanguageModel

    if not isinstance(model, VisionLanguageModel):
        raise K2LabError(
            "--image needs a vision-language checkpoint (e.g. one trained with --preset k25-mini)"
        )
    if tokenizer is None:
        raise K2LabError("--image needs the checkpoint's tokenizer.json (its media tokens) and text prompts")
    if len(images) not in (1, len(texts)):
        raise K2LabError(
            f"give one --image for all prompts or one per prompt, not {len(images)} for {len(texts)}"
        )
    unreadable = (OSError, UnidentifiedImageError, Image.DecompressionBombError)
    with contextlib.ExitStack() as stack:
        opened = []
        for path in images:
            try:
                opened.append(stack.enter_context(Image.open(path)))
            except unreadable as error:
                raise K2LabError(f"cannot read image {path}: {error}") from error
        if len(opened) == 1:
            opened *= len(texts)
        try:
            return image_prompts(tokenizer, model.config.vision, opened, texts)
        except unreadable as error:  # decoded only now: a truncated or corrupt file
            names = ", ".join(map(str, images))
            raise K2LabError(f"cannot read image {names}: {error}") from error
        except ValueError as error:
            raise K2LabError(str(error)) from error


def _media_placeholders(model, prompts: list[list[int]]) -> None:
    """Refuse text prompts holding a vision-language model's image / video placeholder ids (no --image)."""
    from k2lab.vision.vlm import VisionLanguageModel

    if not isinstance(model, VisionLanguageModel):
        return
    for what, token in (("image", model.config.image_token_id), ("video", model.config.video_token_id)):
        count = sum(ids.count(token) for ids in prompts)
        if count:
            raise K2LabError(
                f"the prompt holds {count} {what} placeholder token(s) (id {token}) but no --image was "
                "given: pass --image, or leave the placeholder out of the prompt"
            )


def _check_context(ids: list[int], image_tokens: int, max_new_tokens: int, context: int) -> None:
    """Refuse a prompt (``image_tokens`` of its tokens from images) and generation past the context."""
    if len(ids) + max_new_tokens <= context:  # past it the model was never trained (and ran on)
        return
    prompt = f"a prompt of {len(ids)} tokens"
    if image_tokens:
        prompt += f" ({image_tokens} of them from its image)"
    full = f"{prompt} leaves no room in the model's context of {context} tokens (max_position_embeddings)"
    if len(ids) >= context and image_tokens:
        raise K2LabError(f"{full}: the image is too large for this model's context; give a smaller one")
    if len(ids) >= context:
        raise K2LabError(f"{full}; shorten it")
    raise K2LabError(
        f"{prompt} and --max-new-tokens {max_new_tokens} pass the model's context of {context} tokens "
        f"(max_position_embeddings); ask for at most {context - len(ids)} new tokens"
    )


@app.command()
@runs_config(
    GenerationConfig,
    options={
        "max_new_tokens": Opt("max_new_tokens", help="Tokens to generate per prompt."),
        "temperature": Opt("temperature", help="0 = greedy."),
        "top_p": Opt("top_p", help="Nucleus sampling mass (1 = off)."),
        "seed": Opt("seed", help="Sampling seed."),
    },
)
def generate(
    config: GenerationConfig,
    checkpoint: Annotated[Path, typer.Option("--checkpoint", "-c", help="k2lab or HF checkpoint directory.")],
    prompt: Annotated[
        list[str],
        typer.Option(
            "--prompt",
            help="Text when the checkpoint has a tokenizer.json, else token ids like '1 2 3'; repeat for a batch.",
        ),
    ],
    token_ids: Annotated[bool, typer.Option("--token-ids", help="Read prompts as token ids.")] = False,
    image: Annotated[
        list[Path] | None,
        typer.Option(
            "--image",
            help="An image (PNG, JPEG ...) placed before the prompt, at its native resolution, for a "
            "vision-language checkpoint. Give one for all prompts or one per prompt.",
        ),
    ] = None,
    draft: Annotated[
        Path | None,
        typer.Option(
            "--draft",
            help="Speculative decoding with this draft: a `k2lab draft train` directory, or a small k2lab "
            "model directory with the same vocabulary. Default: CHECKPOINT/draft or the model's MTP layer.",
        ),
    ] = None,
    speculative: Annotated[
        bool | None,
        typer.Option(
            "--speculative/--no-speculative",
            help="Force speculative decoding on or off (default: on when a draft is found, unless on a CPU the "
            "decode step runs compiled or --temperature samples: plain decoding measured faster there).",
        ),
    ] = None,
    draft_tokens: Annotated[
        int, typer.Option("--draft-tokens", min=1, help="Tokens the draft proposes per step (k).")
    ] = DRAFT_TOKENS,
) -> None:
    """Generate continuations with the latent KV cache (absorbed MLA decode); with a draft (--draft, or one
    beside the model), speculatively: output identical to plain decoding when greedy, the same distribution
    when sampling. With --image, from a vision-language checkpoint (K2.5 style) that sees the image first."""
    import time

    from k2lab.infer import generate as run_generation
    from k2lab.infer.speculative import speculative_generate
    from k2lab.model_dir import load_model

    if image and (speculative or draft is not None):
        raise K2LabError(
            "speculative decoding serves text models: --speculative and --draft do not go with --image"
        )
    tokenizer = None
    if not token_ids and (checkpoint / "tokenizer.json").is_file():
        from k2lab.data import load_tokenizer

        tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
    model = load_model(checkpoint).eval()
    media = None
    if image:
        prompts, media = _image_prompts(model, tokenizer, image, prompt)
    else:
        why = "--token-ids was given" if token_ids else "this checkpoint has no tokenizer.json"
        prompts = [tokenizer.encode(text) if tokenizer else parse_token_ids(text, why) for text in prompt]
        _media_placeholders(model, prompts)
    decoder = getattr(model, "language_model", model)
    context = decoder.config.max_position_embeddings
    for ids in prompts:  # the ids' vocabulary is checked by generation (``check_prompts``)
        if not ids:
            raise K2LabError("a prompt encodes to no tokens")
        image_tokens = ids.count(model.config.image_token_id) if media else 0
        _check_context(ids, image_tokens, config.max_new_tokens, context)
    if config.eos_token_id is None:  # the model's own end of sequence unless the recipe names one
        config = config.model_copy(update={"eos_token_id": decoder.config.eos_token_id})
    sampled = config.temperature > 0
    drafter = None if media else _choose_draft(checkpoint, model, draft, speculative, config.compile, sampled)
    _say_decode_weights(decoder, config.compile, config.decode_weights)
    start = time.perf_counter()
    if drafter is None:
        outputs = run_generation(model, prompts, config, media=media)
    else:
        outputs, stats = speculative_generate(model, drafter, prompts, config, num_draft_tokens=draft_tokens)
    seconds = time.perf_counter() - start
    for text, ids, new in zip(prompt, prompts, outputs, strict=True):
        if tokenizer:
            console.print(
                text + tokenizer.decode(new, skip_special_tokens=True), markup=False, highlight=False
            )
        else:
            console.print(f"prompt {ids} -> {new}")
    produced = sum(len(new) for new in outputs)
    console.print(f"{produced} tokens in {seconds:.2f}s ({produced / max(seconds, 1e-9):.1f} tokens/s)")
    if drafter is not None:
        console.print(
            f"speculative (k={draft_tokens}): {stats.tokens_per_step:.2f} tokens per target forward, "
            f"{stats.mean_accepted:.2f} drafted tokens accepted per step ({stats.acceptance_rate:.0%})"
        )


def _say_decode_weights(model, compile: str, requested: str) -> None:
    """Print the dtype a compiled decode step reads its matrices in, and why (nothing when it runs eagerly)."""
    from k2lab.infer.compiled import decode_compile_decision
    from k2lab.infer.decode_weights import decode_weights_choice

    device = next(model.parameters()).device.type
    if decode_compile_decision(compile, device)[0]:
        choice = decode_weights_choice(requested, device, compiled=True)
        console.print(f"decode weights: {choice.describe()}", markup=False, highlight=False)


def _choose_draft(
    checkpoint: Path, model, draft: Path | None, requested: bool | None, compile: str, sampled: bool = False
):
    """The draft to decode with, or None, per ``speculation_decision``; a found draft left unused is said
    with the reason, and --speculative without a draft is an error."""
    from k2lab.infer.speculative import speculation_decision

    if requested is False:
        return None
    drafter = _find_draft(checkpoint, model, draft)
    if requested and drafter is None:
        raise K2LabError(
            "--speculative needs a draft: --draft DIR (generate), CHECKPOINT/draft (`k2lab draft train`) "
            "or an MTP layer"
        )
    use, why = speculation_decision(requested, compile, next(model.parameters()).device.type, sampled)
    if drafter is not None and not use:
        console.print(f"speculative decoding off: {why}")
        return None
    return drafter


def _find_draft(checkpoint: Path, model, draft: Path | None):
    """The draft to use: --draft (an EAGLE draft or a model directory), else the one beside the model."""
    from k2lab.infer.draft import DRAFT_MANIFEST, ModelDraft, check_draft, find_draft, load_draft
    from k2lab.model_dir import load_model
    from k2lab.models.decoder import CausalLM

    if not isinstance(model, CausalLM):
        if draft is not None:
            raise K2LabError("speculative decoding serves text models (not a vision-language checkpoint)")
        return None
    if draft is None:
        return find_draft(checkpoint, model)
    if (draft / DRAFT_MANIFEST).is_file():
        return load_draft(draft, model)
    small = load_model(draft)
    if not isinstance(small, CausalLM):
        raise K2LabError(f"the draft model {draft} must be a text model (not a vision-language checkpoint)")
    drafter = ModelDraft(small.eval())
    check_draft(model, drafter)  # now, though the decision below may leave it unused
    return drafter


@draft_app.command("train")
@runs_config(
    DraftTrainConfig,
    options={
        name: Opt(name)
        for name in (
            "model",
            "out",
            "data",
            "prompts",
            "continuation",
            "temperature",
            "steps",
            "batch_size",
            "lr",
            "fresh",
            "draft_vocab",
            "seed",
        )
    },
)
def draft_train(config: DraftTrainConfig) -> None:
    """Fine-tune the model's MTP layer (or a fresh one-block draft, --fresh) into an EAGLE-style draft on
    the model's own hidden states and continuations of corpus prompts, proposing among the --draft-vocab
    most frequent tokens of those continuations; saved to MODEL/draft/, where `k2lab generate` finds it."""
    from k2lab.infer.draft import DRAFT_DIR
    from k2lab.train.draft import train_draft

    out = config.out or config.model / DRAFT_DIR
    kept = "no new draft (it is saved when training ends)"
    with reports_interrupt(out, lambda: kept, "run the same command again to train it"):
        summary = train_draft(config, log=lambda line: console.print(line, markup=False, highlight=False))
    console.print(
        f"tokens per target forward on held-out prompts: {summary['tokens_per_step_before']:.2f} -> "
        f"{summary['tokens_per_step_after']:.2f}"
    )


@app.command()
@runs_config(
    ServeConfig,
    options={
        name: Opt(name)
        for name in (
            "host",
            "port",
            "model_name",
            "max_batch",
            "max_context",
            "prefix_cache_mb",
            "prefix_block_size",
            "compile",
            "decode_weights",
            "draft_tokens",
        )
    }
    | {"speculative": Opt("speculative", "--speculative/--no-speculative")},
)
def serve(
    config: ServeConfig,
    checkpoint: Annotated[
        Path,
        typer.Option("--checkpoint", "-c", help="k2lab or HF checkpoint directory with a tokenizer.json."),
    ],
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="K2LAB_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* (or $K2LAB_API_KEY)."
        ),
    ] = None,
) -> None:
    """Serve a checkpoint over an OpenAI-compatible API: /v1/models, /v1/chat/completions (streaming, tool
    calls constrained to the declared JSON Schemas), /health. Text only: a vision-language checkpoint is
    served through its language model, and image parts are refused."""
    from k2lab.model_dir import check_model_directory
    from k2lab.serve.listen import bind

    if not (check_model_directory(checkpoint) / "tokenizer.json").is_file():
        raise K2LabError(f"{checkpoint} has no tokenizer.json: the server renders chats to text and back")
    with bind(config.host, config.port) as sock:  # a port in use fails now, before the model loads
        _serve(config, checkpoint, api_key, sock)


def _serve(config: ServeConfig, checkpoint: Path, api_key: str | None, sock: socket.socket) -> None:
    """Load the model, start the engine and serve on ``sock`` until interrupted."""
    from k2lab.data import load_tokenizer
    from k2lab.model_dir import load_model
    from k2lab.serve import Engine
    from k2lab.serve.background_compile import background_compiles
    from k2lab.serve.listen import serve_on
    from k2lab.serve.server import build_app, context_limit
    from k2lab.serve.threads import hand_threads_to_engine

    threads = hand_threads_to_engine()  # one OpenMP team, the engine's
    tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
    model = load_model(checkpoint)
    if hasattr(model, "language_model"):  # images are not served yet: text through the decoder
        console.print("vision-language checkpoint: its vision tower is not served (text only)")
        model = model.language_model
    context_limit(config.max_context, model.config)  # before the engine starts, as is the next check
    tokenizer.check_fits(model.config.vocab_size)
    background = background_compiles(config.compile, next(model.parameters()).device.type)
    compile = "on" if background else config.compile  # what decoding becomes, for the choices below
    drafter = _choose_draft(checkpoint, model, None, config.speculative, compile)
    _say_decode_weights(model, compile, config.decode_weights)
    if background:
        console.print("decode step: eager until the compiled step is built in the background (/health)")
    engine = Engine(
        model,
        config.max_batch,
        config.prefix_cache_mb << 20,
        config.prefix_block_size,
        config.compile,
        draft=drafter,
        draft_tokens=config.draft_tokens,
        decode_weights=config.decode_weights,
        sampled_drafts=True if config.speculative else None,  # --speculative: every request drafts
        background_compile=background,
        threads=threads,
    ).start()
    name = config.model_name or checkpoint.resolve().name
    app_ = build_app(engine, tokenizer, name, api_key=api_key, max_context=config.max_context)
    spec = f", speculative k={config.draft_tokens}" if drafter is not None else ""
    if engine.speculation is not None and not engine.speculation.sampled_drafts:
        why = engine.speculation.sampled_reason
        console.print(f"sampled requests (temperature > 0) decode plainly: {why}", soft_wrap=True)
    port = sock.getsockname()[1]  # the one taken for --port 0
    console.print(f"serving {name} on http://{config.host}:{port}/v1 (max batch {config.max_batch}{spec})")
    interrupted = False
    try:
        serve_on(app_, sock)
    except KeyboardInterrupt:  # uvicorn stops on Ctrl-C, then raises it again: exit 130, quietly
        interrupted = True
        raise
    finally:
        engine.shutdown()
        if engine.background is not None and engine.background.building():
            # a build in progress cannot be stopped, and the interpreter's exit under it aborts (C++ threads
            # inside inductor): leave at once, everything of ours is shut down
            console.print("stopped during the background build of the decode step")
            sys.stdout.flush()
            os._exit(130 if interrupted else 0)
