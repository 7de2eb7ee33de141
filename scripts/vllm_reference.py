"""k2lab's side of ``scripts/vllm_check.py``: the models to export and k2lab's reference outputs.

Run with k2lab's venv (vLLM lives in a venv of its own with other transformers / torch pins, so the check
never imports k2lab there; it runs this script and reads its JSON)::

    .venv/bin/python scripts/vllm_reference.py --out runs/vllm [--demo /tmp/spec/demo]

Writes under ``--out``:

* ``src/<name>/``: k2lab model directories (weights + tokenizer.json) of
  ``deepseek`` (the demo k2-mini's shape with DeepSeek's latent widths, kv_lora_rank 512 and qk_rope_head_dim 64,
  so vLLM's MLA kernel, which takes only a 576-wide latent head, runs; 2 layers, random weights, seed 0),
  ``linear`` (a 2-layer Kimi Linear: KDA then MLA without rope, random) and ``tools`` (the demo model after
  ``--sft-steps`` Adam steps on tool-call conversations, so that it emits tool calls by itself);
* ``export/<name>/``: ``k2lab export`` of each, and of the demo model as ``k2-mini``;
* ``reference.json``: per model of ``--greedy-models``, the prompts' ids, k2lab's greedy continuations
  (``generate``, fp32, no EOS stop, ``--max-new-tokens``) one prompt at a time and as one left-padded batch, and
  the prompt log-probs: for every position i ≥ 1 and the ``--top`` most likely tokens v there plus the prompt's
  own token, log p(v | t_<i) = z_{i-1}[v] − logsumexp z_{i-1} from one forward over the prompt (logits [T, V]).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
from pathlib import Path

import torch

from k2lab.config import ModelConfig
from k2lab.data import load_tokenizer
from k2lab.data.tokenizer import Tokenizer
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.model_dir import load_model, save_model
from k2lab.models import build_model
from k2lab.runtime.chat import ToolCallParseError, encode_chat, parse_assistant, render_chat, tool_call_id

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "def main():\n",
    "import os\nimport sys\n\n",
    "class Parser:\n    def __init__(self, text):\n        self.",
    "for i in range(len(items)):\n    if ",
    '"""Return the number of',
    "x",
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a timezone.",
     "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}},
]  # fmt: skip
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Rome", "Seoul", "Dakar"]
RAW_CALL = re.compile(
    r"<\|tool_call_begin\|>(functions\.([\w-]+):\d+)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>"
)
ZONES = ["UTC", "Europe/Berlin", "Asia/Tokyo", "America/Lima", "Africa/Cairo", "Asia/Seoul"]


def tool_conversation(rng: random.Random) -> list[dict]:
    """A user question and the assistant's one tool call answering it (get_weather or get_time)."""
    if rng.random() < 0.6:
        city = rng.choice(CITIES)
        question, name, arguments = f"What is the weather in {city}?", "get_weather", {"city": city}
    else:
        zone = rng.choice(ZONES)
        question, name, arguments = f"What time is it in {zone}?", "get_time", {"timezone": zone}
    call = {"id": tool_call_id(name, 0), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip
    return [{"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_calls": [call]}]


def sft_tools(model: torch.nn.Module, tokenizer: Tokenizer, steps: int, seed: int = 0) -> list[float]:
    """``steps`` Adam steps (lr 1e-3, 8 conversations each) of the SFT loss on the assistant tokens:
    L = −mean_{t: mask_t} log p(t_i | t_<i) over ids [B, T] (right-padded, padding masked out)."""
    rng = random.Random(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    model.train()
    for _ in range(steps):
        encodings = [encode_chat(tokenizer, tool_conversation(rng), TOOLS) for _ in range(8)]
        width = max(len(e.ids) for e in encodings)
        ids = torch.zeros(len(encodings), width, dtype=torch.long)
        mask = torch.zeros(len(encodings), width, dtype=torch.bool)
        for row, e in enumerate(encodings):
            ids[row, : len(e.ids)] = torch.tensor(e.ids)
            mask[row, : len(e.ids)] = torch.tensor(e.assistant_mask)
        logits = model(ids[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        print(f"tool SFT step {len(losses)}/{steps}: loss {losses[-1]:.3f}", flush=True)
    return losses


def variant(base: ModelConfig, name: str) -> ModelConfig:
    """The demo's config with DeepSeek's latent widths (``deepseek``) or as a 2-layer Kimi Linear (``linear``)."""
    fields = base.model_dump()
    if name == "deepseek":
        fields.update(
            name="k2-mini-deepseek-latent", num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64
        )
    else:
        fields.update(name="k2-mini-kimi-linear", num_hidden_layers=2, mla_layers=(2,), mla_rope=False,
                      linear_num_heads=4, linear_head_dim=32)  # fmt: skip
    return ModelConfig(**fields)


def build_sources(demo: Path, out: Path, sft_steps: int) -> dict[str, Path]:
    """k2lab model directories of the variants and the tool-call model; the demo is exported as it is."""
    tokenizer = load_tokenizer(demo / "tokenizer.json")
    base = load_model(demo).config
    sources = {"k2-mini": demo}
    for name in ("deepseek", "linear"):
        sources[name] = save_model(build_model(variant(base, name), seed=0), out / "src" / name)
    model = load_model(demo)
    losses = sft_tools(model, tokenizer, sft_steps)
    print(f"tool SFT: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {sft_steps} steps", flush=True)
    sources["tools"] = save_model(model.eval(), out / "src" / "tools")
    for name in ("deepseek", "linear", "tools"):
        shutil.copy(demo / "tokenizer.json", sources[name] / "tokenizer.json")
    return sources


def export_all(sources: dict[str, Path], out: Path) -> dict[str, str]:
    exports = {}
    for name, source in sources.items():
        target = out / "export" / name
        subprocess.run(
            [str(ROOT / ".venv/bin/k2lab"), "export", str(source), "--out", str(target)], check=True
        )
        exports[name] = str(target)
    return exports


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, ids: list[int], top: int) -> list[dict[str, float]]:
    """Per position i ≥ 1: {token id: log p} for the ``top`` most likely tokens and ids[i] (logits [T, V])."""
    logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    rows = []
    for i in range(1, len(ids)):
        picked = set(logp[i - 1].topk(top).indices.tolist()) | {ids[i]}
        rows.append({str(v): float(logp[i - 1, v]) for v in sorted(picked)})
    return rows


def reference(export: Path, prompts: list[list[int]], max_new_tokens: int, top: int) -> dict:
    model = load_model(export).eval()  # the HF export itself, read back by k2lab (fp32)
    config = GenerationConfig(max_new_tokens=max_new_tokens, compile="off")
    return {
        "prompts": prompts,
        "greedy_single": [generate(model, [p], config)[0] for p in prompts],
        "greedy_batched": generate(model, prompts, config),
        "prompt_logprobs": [prompt_logprobs(model, p, top) for p in prompts],
    }


@torch.inference_mode()
def chat_greedy(export: Path, requests: list[dict], max_tokens: int) -> list[dict]:
    """k2lab's greedy turn for each chat request WITHOUT the tool-call enforcer (what vLLM's ``auto`` does):
    ``render_chat(messages, tools)``, ``generate`` up to ``<|im_end|>``, ``parse_assistant`` of the text."""
    model, tokenizer = load_model(export).eval(), load_tokenizer(export / "tokenizer.json")
    end = tokenizer.special_tokens["<|im_end|>"]
    config = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=end, compile="off")
    turns = []
    for request in requests:
        prompt = tokenizer.encode(render_chat(request["messages"], tools=request.get("tools")))
        text = tokenizer.decode(generate(model, [prompt], config)[0])
        try:
            message, problem = parse_assistant(text), None
            calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message.get("tool_calls") or []]  # fmt: skip
        except ToolCallParseError as error:  # e.g. arguments that are not JSON: the calls as written
            message, problem = {"content": text}, str(error)
            calls = [{"id": m[1], "name": m[2], "arguments": m[3]} for m in RAW_CALL.finditer(text)]
        turns.append({"text": text, "content": message.get("content") or "", "tool_calls": calls,
                      "parse_error": problem})  # fmt: skip
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", type=Path, default=Path("/tmp/spec/demo"))
    parser.add_argument("--out", type=Path, default=ROOT / "runs/vllm")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--greedy-models", nargs="+", default=["k2-mini", "deepseek"])
    parser.add_argument("--chat", nargs=3, metavar=("EXPORT", "REQUESTS", "RESULT"),
                        help="only: k2lab's unconstrained greedy turns of REQUESTS (JSON [{messages, tools}])")  # fmt: skip
    parser.add_argument("--chat-max-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.chat:
        export, requests, result = (Path(x) for x in args.chat)
        turns = chat_greedy(export, json.loads(requests.read_text()), args.chat_max_tokens)
        result.write_text(json.dumps(turns) + "\n")
        return
    torch.manual_seed(0)
    exports = export_all(build_sources(args.demo, args.out, args.sft_steps), args.out)
    tokenizer = load_tokenizer(args.demo / "tokenizer.json")
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    result = {"exports": exports, "prompt_texts": PROMPTS, "tools": TOOLS, "models": {}}
    for name in args.greedy_models:
        result["models"][name] = reference(Path(exports[name]), prompts, args.max_new_tokens, args.top)
    (args.out / "reference.json").write_text(json.dumps(result) + "\n")
    print(args.out / "reference.json")


if __name__ == "__main__":
    main()
