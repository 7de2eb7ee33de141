"""The agentic data factory: tool repository, simulator, tasks and rubrics, experts, judge, CLI."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from k2lab.agentic.domains import BASE_TOOLS, BASES, DOMAINS, initial_world
from k2lab.agentic.domains.base import BaseTool, ToolError
from k2lab.agentic.domains.math import safe_calculate
from k2lab.agentic.episodes.env import Episode
from k2lab.agentic.factory.experts import EXPECTED_REASONS, MODES, ExpertAgent
from k2lab.agentic.factory.judge import judge, reason_category, solution_progress
from k2lab.agentic.factory.pipeline import FactoryConfig, generate, rollout
from k2lab.agentic.factory.simulator import FailureRates, ToolSimulator
from k2lab.agentic.factory.tasks import MINI_TOOLS, ToolTaskEnvironment, tool_env
from k2lab.agentic.factory.tools import SyntheticTool, build_repository, evolve, load_mcp_tools
from k2lab.cli import main
from k2lab.errors import K2LabError
from k2lab.runtime.chat import normalize_messages, parse_chat, render_chat
from k2lab.runtime.tool_spec import validate_tools

ROOT = Path(__file__).resolve().parents[3]
FORECAST_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
FORECAST_OUTPUT = {
    "type": "object",
    "properties": {"temperature": {"type": "number"}, "summary": {"type": "string"}},
    "required": ["temperature", "summary"],
}


def harvested_line(name: str, parameters: dict, output: dict | None = None, server: str = "weather") -> str:
    """One line of ``k2lab tools harvest`` output."""
    openai = {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": parameters},
    }
    record = {
        "server": server,
        "name": name,
        "original_name": name,
        "title": None,
        "description": f"{name} tool",
        "parameters": parameters,
        "output_schema": output,
        "annotations": {},
        "openai": openai,
    }
    return json.dumps(record)


@pytest.fixture(scope="module")
def mcp_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mcp") / "tools.jsonl"
    lines = [
        harvested_line("get_forecast", FORECAST_SCHEMA, FORECAST_OUTPUT),
        harvested_line("checkout", {"type": "object", "properties": {}}),  # clashes with a synthetic tool
        harvested_line("list_alerts", {"type": "object", "properties": {"region": {"type": "string"}}}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def repository():
    return build_repository(seed=0)


@pytest.fixture(scope="module")
def env(repository) -> ToolTaskEnvironment:
    return ToolTaskEnvironment(repository, FailureRates.from_total(0.2))


def tool_of(repository, base: str, predicate=lambda tool: True) -> SyntheticTool:
    return next(t for t in repository.synthetic.values() if t.base.key == base and predicate(t))


# ------------------------------------------------------------------------------------------ repository


def test_hundreds_of_distinct_valid_tools(repository):
    specs = repository.specs()
    assert len(repository.synthetic) >= 300
    validate_tools(specs)  # raises on any problem, including duplicate names
    for spec in specs:
        Draft202012Validator.check_schema(spec["function"]["parameters"])
    distinct = {
        json.dumps(spec["function"]["parameters"], sort_keys=True) + spec["function"]["name"]
        for spec in specs
    }
    assert len(distinct) == len(specs)
    assert set(repository.by_domain()) == set(DOMAINS)
    assert all(len(families) >= 1 for families in repository.hierarchy().values())
    # evolution really varies the interface, not only the name
    assert len({json.dumps(s["function"]["parameters"], sort_keys=True) for s in specs}) > 150


def test_evolve_is_deterministic():
    first = [t.spec for t in evolve(7, 60)]
    assert first == [t.spec for t in evolve(7, 60)]
    assert first != [t.spec for t in evolve(8, 60)]
    assert [t.spec for t in build_repository(3).synthetic.values()] == [
        t.spec for t in build_repository(3).synthetic.values()
    ]


def canonical_sample(base: BaseTool) -> dict:
    samples = {"money": 12.5, "day": "wed", "hour": 14, "unit": "km"}
    args = {}
    for param in base.params:
        schema = param.schema
        if param.kind in samples:
            args[param.name] = samples[param.kind]
        elif "enum" in schema:
            args[param.name] = schema["enum"][0]
        else:
            args[param.name] = {"string": "x", "integer": 2, "number": 3.0, "array": [1.0]}[schema["type"]]
    return args


def test_variants_encode_valid_arguments_and_decode_back(repository):
    for tool in repository.synthetic.values():
        canonical = canonical_sample(tool.base)
        arguments = tool.encode(canonical)
        errors = list(Draft202012Validator(tool.parameters).iter_errors(arguments))
        assert not errors, (tool.name, arguments, errors)
        assert tool.decode(arguments) == canonical, tool.name


# ------------------------------------------------------------------------------------------ semantics


def fresh_world() -> dict:
    world = initial_world(random.Random(0))
    world["retail"]["catalog"] = {"apple": {"price": 0.5, "stock": 3}, "milk": {"price": 1.2, "stock": 9}}
    world["bank"]["accounts"] = {"checking": 100.0, "savings": 20.0}
    return world


def test_retail_semantics(repository):
    world = fresh_world()
    add, checkout = repository.synthetic["add_to_cart"], repository.synthetic["checkout"]
    assert add.execute(world, {"item": "apple", "qty": 2}) == {"cart": {"apple": 2}}
    with pytest.raises(ToolError) as error:
        add.execute(world, {"item": "apple", "qty": 2})
    assert error.value.kind == "out_of_stock"
    with pytest.raises(ToolError, match="unknown item") as error:
        add.execute(world, {"item": "caviar", "qty": 1})
    assert error.value.kind == "unknown_item"
    order = checkout.execute(world, {})
    assert (order["order_id"], order["total"], order["items"]) == ("O-1001", 1.0, {"apple": 2})
    assert world["retail"]["cart"] == {} and world["retail"]["catalog"]["apple"]["stock"] == 1
    with pytest.raises(ToolError) as error:
        checkout.execute(world, {})
    assert error.value.kind == "empty_cart"


def test_bank_semantics_through_a_cents_variant(repository):
    world = fresh_world()
    cents = tool_of(
        repository, "transfer", lambda t: "amount" in t.codecs and t.codecs["amount"].factor == 100
    )
    names = cents.arg_names
    result = cents.execute(
        world, {names["source"]: "checking", names["target"]: "savings", names["amount"]: 2550}
    )
    assert result["amount"] == 25.5
    assert world["bank"]["accounts"] == {"checking": 74.5, "savings": 45.5}
    with pytest.raises(ToolError) as error:
        cents.execute(
            world, {names["source"]: "savings", names["target"]: "checking", names["amount"]: 10_000}
        )
    assert error.value.kind == "insufficient_funds"
    with pytest.raises(ToolError) as error:
        cents.execute(world, {names["source"]: "nowhere", names["target"]: "checking", names["amount"]: 1})
    assert error.value.kind == "unknown_account"
    assert world["bank"]["accounts"] == {"checking": 74.5, "savings": 45.5}  # errors change nothing


def test_calendar_semantics_through_evolved_units(repository):
    world = fresh_world()
    variant = tool_of(repository, "create_event", lambda t: {"day", "hour"} <= set(t.codecs))
    arguments = variant.encode({"title": "yoga", "day": "fri", "hour": 7})
    assert variant.execute(world, arguments) == {"created": {"title": "yoga", "day": "fri", "hour": 7}}
    with pytest.raises(ToolError) as error:  # the standup holds monday 9:00
        repository.synthetic["create_event"].execute(world, {"title": "x", "day": "mon", "hour": 9})
    assert error.value.kind == "conflict"
    repository.synthetic["move_event"].execute(world, {"title": "yoga", "day": "sat", "hour": 10})
    assert {"title": "yoga", "day": "sat", "hour": 10} in world["calendar"]["events"]


def test_files_math_inventory_travel_semantics(repository):
    world, tools = fresh_world(), repository.synthetic
    tools["write_file"].execute(world, {"path": "notes.txt", "text": "hello"})
    tools["append_file"].execute(world, {"path": "notes.txt", "text": " world"})
    assert tools["read_file"].execute(world, {"path": "notes.txt"})["text"] == "hello world"
    for path, kind in (("../etc/passwd", "invalid_path"), ("missing.txt", "file_not_found")):
        with pytest.raises(ToolError) as error:
            tools["read_file"].execute(world, {"path": path})
        assert error.value.kind == kind
    assert safe_calculate("(2 + 3) * 4") == 20
    for expression, kind in (("1 / 0", "division_by_zero"), ("__import__('os')", "invalid_expression")):
        with pytest.raises(ToolError) as error:
            safe_calculate(expression)
        assert error.value.kind == kind
    converted = tools["convert_units"].execute(world, {"value": 1, "from_unit": "km", "to_unit": "mi"})
    assert converted == {"value": 0.6214, "unit": "mi"}
    world["inventory"]["stock"]["SKU-100"] = 3
    with pytest.raises(ToolError) as error:
        tools["ship_order"].execute(world, {"sku": "SKU-100", "qty": 4, "address": "here"})
    assert error.value.kind == "insufficient_stock"
    flight = world["travel"]["flights"][0]
    flight["seats"] = 1
    booking = tools["book_flight"].execute(world, {"flight_id": flight["id"], "passenger": "Ada"})
    assert booking["booking_id"] == "B-301" and flight["seats"] == 0
    with pytest.raises(ToolError) as error:
        tools["book_flight"].execute(world, {"flight_id": flight["id"], "passenger": "Bob"})
    assert error.value.kind == "sold_out"
    tools["cancel_booking"].execute(world, {"booking_id": "B-301"})
    assert flight["seats"] == 1 and world["travel"]["bookings"] == []


# ------------------------------------------------------------------------------------------ simulator


def test_failure_injection_rates_match_the_configuration(repository):
    rates = FailureRates(transient=0.2, rate_limit=0.1, partial=0.1, empty=0.1)
    simulator = ToolSimulator(repository, rates)
    world = fresh_world()
    snapshot = copy.deepcopy(world)
    kinds = Counter(
        simulator.execute(world, "list_files", "{}", seed=5, call_index=i).kind for i in range(1000)
    )
    assert world == snapshot  # injected failures and edge cases never touch the world
    assert kinds["service_unavailable"] / 1000 == pytest.approx(0.2, abs=0.05)
    assert kinds["rate_limited"] / 1000 == pytest.approx(0.1, abs=0.04)
    successes = kinds["ok"] + kinds["partial"] + kinds["empty"]
    assert kinds["partial"] / successes == pytest.approx(0.1, abs=0.04)  # of the calls that got through
    assert kinds["empty"] / successes == pytest.approx(0.1, abs=0.04)
    again = [simulator.execute(world, "list_files", "{}", seed=5, call_index=i).content for i in range(50)]
    assert again == [
        simulator.execute(world, "list_files", "{}", seed=5, call_index=i).content for i in range(50)
    ]


def test_transient_failures_leave_state_untouched(repository):
    simulator = ToolSimulator(repository, FailureRates(transient=1.0))
    world = fresh_world()
    observation = simulator.execute(world, "deposit", {"account": "savings", "amount": 5})
    assert (observation.kind, observation.retryable, world["bank"]["accounts"]["savings"]) == (
        "service_unavailable",
        True,
        20.0,
    )


@pytest.mark.parametrize(
    ("name", "arguments", "kind"),
    [
        ("deposit", "{not json", "malformed_arguments"),
        ("deposit", "[1, 2]", "malformed_arguments"),
        ("deposit", 42, "malformed_arguments"),
        ("no_such_tool", "{}", "unknown_tool"),
        (None, "{}", "unknown_tool"),
        ("deposit", '{"account": "savings"}', "invalid_arguments"),
        ("deposit", '{"account": "savings", "amount": "lots"}', "invalid_arguments"),
        ("deposit", '{"account": "savings", "amount": 5, "extra": 1}', "invalid_arguments"),
        ("deposit", '{"account": "nowhere", "amount": 5}', "unknown_account"),
    ],
)
def test_bad_calls_become_error_observations(repository, name, arguments, kind):
    observation = ToolSimulator(repository).execute(fresh_world(), name, arguments)
    body = json.loads(observation.content)
    assert (observation.ok, observation.kind, body["ok"], body["error"]["type"]) == (False, kind, False, kind)
    assert body["error"]["message"]


def test_a_crashing_tool_is_an_observation(repository):
    def crash(world: dict, args: dict) -> None:
        raise RuntimeError("boom")

    broken = SyntheticTool("crashy", BaseTool("crashy", "files", "io", "Crashes.", (), crash), "Crashes.", {})
    repository_copy = build_repository(seed=0, variants_per_tool=0)
    repository_copy.add_synthetic([broken])
    observation = ToolSimulator(repository_copy).execute({}, "crashy", "{}")
    assert observation.kind == "tool_crashed" and "boom" in observation.reason


def test_mcp_tools_get_schema_conforming_results(mcp_file):
    records = load_mcp_tools(mcp_file)
    repository = build_repository(seed=0, variants_per_tool=1, mcp_path=mcp_file)
    assert len(records) == 3 and {"get_forecast", "mcp_checkout", "list_alerts"} <= set(repository.mcp)
    simulator = ToolSimulator(repository)
    for index in range(20):
        observation = simulator.execute(
            {}, "get_forecast", {"city": "Oslo", "days": 3}, seed=1, call_index=index
        )
        assert observation.ok
        Draft202012Validator(FORECAST_OUTPUT).validate(observation.result)
    assert simulator.execute({}, "get_forecast", {"city": "Oslo", "days": 9}).kind == "invalid_arguments"


def test_bad_harvest_file_is_reported(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"name": "ok", "openai": {"type": "function", "function": {"name": "bad name!"}}}\n')
    with pytest.raises(K2LabError, match="bad.jsonl:1"):
        load_mcp_tools(path)


# ------------------------------------------------------------------------------------------ environment


def test_reset_is_deterministic_and_tasks_have_rubrics(env):
    assert env.reset(11).to_dict() == env.reset(11).to_dict()
    kinds, needs_tools, clarifying, multi = Counter(), Counter(), 0, 0
    for seed in range(150):
        episode = env.reset(seed)
        task = episode.state["task"]
        validate_tools(episode.tools)
        assert episode.messages[0]["role"] == "system" and episode.messages[1]["role"] == "user"
        assert task["rubric"]["items"] and (task["rubric"]["final_state"] or not episode.needs_tools)
        kinds[task["kind"]] += 1
        needs_tools[episode.needs_tools] += 1
        clarifying += any(p["clarification"] for p in task["phases"])
        multi += len(task["phases"]) > 1
    assert needs_tools[False] >= 10 and needs_tools[True] >= 100
    assert len(kinds) >= 15 and clarifying >= 5 and multi >= 5


def test_step_never_raises_on_garbage(env):
    episode = env.reset(3)
    env.step(episode, {"role": "assistant", "tool_calls": [{"nonsense": True}, {"function": {"name": 3}}]})
    assert [json.loads(m["content"])["error"]["type"] for m in episode.messages[-2:]] == [
        "malformed_call"
    ] * 2
    env.step(episode, {"role": "assistant", "tool_calls": [{"function": {"name": "x", "arguments": "{{"}}]})
    assert json.loads(episode.messages[-1]["content"])["error"]["type"] == "unknown_tool"
    env.step(episode, "not a message")
    assert episode.done and not episode.outcome.success
    done = env.reset(4)
    env.step(done, {"role": "assistant", "tool_calls": "oops"})
    assert done.done and done.outcome.details["ended"] == "malformed tool call"


def test_turn_limit_ends_the_episode(env):
    episode = env.reset(5)
    while not episode.done:
        env.step(episode, {"role": "assistant", "content": "Hmm?"})
    assert episode.turns == episode.max_turns and not episode.outcome.success
    assert "unfinished" in {reason_category(r) for r in episode.outcome.details["reasons"]}


def test_episodes_resume_from_their_dict(env, repository):
    expert = ExpertAgent(repository)
    whole = rollout(env, expert, 21)
    episode = env.reset(21)
    env.step(episode, expert(episode))
    resumed = Episode.from_dict(json.loads(json.dumps(episode.to_dict())))
    while not resumed.done:
        env.step(resumed, expert(resumed))
    assert resumed.to_dict() == whole.to_dict()


# ------------------------------------------------------------------------------------------ experts and judge


def test_perfect_expert_passes_every_task(env, repository):
    expert = ExpertAgent(repository, imperfection=0.0)
    outcomes = Counter()
    for seed in range(120):
        episode = rollout(env, expert, seed)
        outcomes[episode.outcome.success] += 1
        if not episode.outcome.success:  # only an outage longer than the expert's patience may fail
            assert episode.messages[-1]["content"].startswith("Sorry, the service keeps failing"), (
                episode.outcome
            )
    assert outcomes[True] >= 116
    clean = ToolTaskEnvironment(repository, FailureRates())
    assert all(rollout(clean, expert, seed).outcome.success for seed in range(60))


@pytest.mark.parametrize("mode", MODES)
def test_imperfect_experts_are_rejected_for_the_right_reason(env, repository, mode):
    expert = ExpertAgent(repository, mode=mode)
    for seed in range(30):
        episode = rollout(env, expert, seed)
        assert not episode.outcome.success, (mode, episode.task_id)
        categories = {reason_category(r) for r in episode.outcome.details["reasons"]}
        assert categories & EXPECTED_REASONS[mode], (
            mode,
            episode.task_id,
            episode.outcome.details["reasons"],
        )


def test_no_tool_tasks_punish_tool_calls(repository):
    env = ToolTaskEnvironment(repository, no_tool_fraction=1.0)
    for seed in range(10):
        good = rollout(env, ExpertAgent(repository), seed)
        assert not good.needs_tools and good.outcome.success and good.tool_calls == 0
        bad = rollout(env, ExpertAgent(repository, mode="unnecessary_call"), seed)
        assert "tool_on_no_tool_task" in {reason_category(r) for r in bad.outcome.details["reasons"]}


def test_partial_credit_ranks_failures_below_every_success(repository):
    strict = ToolTaskEnvironment(repository, FailureRates(), no_tool_fraction=0.0)
    graded = ToolTaskEnvironment(repository, FailureRates(), no_tool_fraction=0.0, partial_credit=0.5)
    for seed in range(12):
        good = rollout(graded, ExpertAgent(repository, imperfection=0.0), seed)
        assert good.outcome.success and good.reward == 1.0
        bad = rollout(graded, ExpertAgent(repository, mode="wrong_argument"), seed)
        checks = bad.outcome.details["checks"]
        met = sum(c["ok"] for c in checks) / len(checks)
        assert not bad.outcome.success and 0 < met < 1
        assert bad.reward == pytest.approx(0.5 * met) and bad.reward < 0.5
        assert rollout(strict, ExpertAgent(repository, mode="wrong_argument"), seed).reward == 0.0
    with pytest.raises(ValueError, match="partial_credit"):
        ToolTaskEnvironment(repository, partial_credit=1.0)


def test_solution_progress_grades_planned_calls_and_answers_by_hand():
    """One score per planned call (1 if made, else the best k / (n + 1) over calls of that tool) and one for
    the answer's key facts; nothing for what doing nothing satisfies."""
    rubric = {
        "final_state": [
            {"kind": "stock", "sku": "SKU-400", "qty": 51},
            {"kind": "called", "tool": "restock", "args": {"sku": "SKU-400", "qty": 41}, "outcome": "ok"},
            {"kind": "called", "tool": "list_skus", "args": {}, "outcome": "ok"},
        ],
        "items": [
            {"kind": "finished"},
            {"kind": "confirmed_result", "terms": [["SKU-400", "51"]]},
            {"kind": "only_needed_tools", "allowed": ["restock", "list_skus"]},
        ],
    }

    def call(tool, args, ok=True):
        return {"tool": tool, "args": args, "ok": ok, "kind": "ok" if ok else "error"}

    answer = [{"role": "assistant", "content": "SKU-400 now has 51 units."}]
    nothing = [{"role": "assistant", "content": "Done."}]
    assert solution_progress(rubric, [], nothing) == 0.0
    # restock with the right SKU, wrong quantity (1 / 3); list_skus made (1); answer states 1 of 2 terms
    wrong_qty = [call("restock", {"sku": "SKU-400", "qty": 14}), call("list_skus", {})]
    half = [{"role": "assistant", "content": "SKU-400 is restocked."}]
    assert solution_progress(rubric, wrong_qty, half) == pytest.approx((1 / 3 + 1 + 1 / 2) / 3)
    # every value wrong scores 0 for that call, however often it is tried; the best attempt counts
    tries = [call("restock", {"sku": "SKU-500", "qty": 1}), call("restock", "not json", ok=False)]
    assert solution_progress(rubric, tries, nothing) == 0.0
    tries.append(call("restock", {"qty": 41}))
    assert solution_progress(rubric, tries, nothing) == pytest.approx((1 / 3) / 3)
    solved = [call("restock", {"sku": "SKU-400", "qty": 41.0}), call("list_skus", {})]
    assert solution_progress(rubric, solved, answer) == 1.0
    assert solution_progress({"final_state": [], "items": [{"kind": "finished"}]}, [], answer) == 0.0


def test_progress_credit_gives_inaction_nothing(repository):
    """With ``credit="progress"`` a failure earns partial_credit x solution progress: an answer without a
    tool call earns less than a call with the wrong argument, which the per-check credit does not ensure."""

    def env(credit):
        return ToolTaskEnvironment(
            repository, FailureRates(), no_tool_fraction=0.0, partial_credit=0.5, credit=credit
        )

    progress, checks = env("progress"), env("checks")
    ahead = 0
    for seed in range(12):
        good = rollout(progress, ExpertAgent(repository, imperfection=0.0), seed)
        assert good.outcome.success and good.reward == 1.0
        wrong = rollout(progress, ExpertAgent(repository, mode="wrong_argument"), seed)
        assert not wrong.outcome.success and 0 <= wrong.reward < 0.5
        idle = rollout(progress, ExpertAgent(repository, mode="premature_answer"), seed)
        assert not idle.outcome.success and idle.reward <= wrong.reward
        ahead += idle.reward < wrong.reward
        assert wrong.reward == pytest.approx(0.5 * wrong.outcome.details["progress"], abs=1e-6)
        # per-check credit pays the idle answer for "nothing changed", "no question", "no extra tool"
        assert rollout(checks, ExpertAgent(repository, mode="premature_answer"), seed).reward >= 0.2
    assert ahead >= 10  # ties: a call whose every value is wrong, and an answer without its facts
    with pytest.raises(ValueError, match="credit"):
        ToolTaskEnvironment(repository, credit="vibes")


def test_tool_environments_by_name():
    files = tool_env("mini-tools:files")
    tasks = [files.reset(seed) for seed in range(20)]
    assert {e.state["task"]["domain"] for e in tasks} == {"files"}
    canonical = {base.key for base in BASE_TOOLS}
    for episode in tasks:
        names = {t["function"]["name"] for t in episode.tools}
        assert names <= canonical and len(names - {b.key for b in BASE_TOOLS if b.domain == "files"}) <= 1
        assert episode.max_turns <= MINI_TOOLS["max_turns"]
    assert files.partial_credit == MINI_TOOLS["partial_credit"]
    bank = tool_env("tools:bank")
    assert {bank.reset(s).state["task"]["domain"] for s in range(10)} == {"bank"}
    assert {tool_env("tools").reset(s).state["task"]["domain"] for s in range(60)} == set(DOMAINS)
    with pytest.raises(ValueError, match="unknown tool domains"):
        tool_env("mini-tools:garden")
    with pytest.raises(ValueError, match="unknown tool environment"):
        tool_env("maxi-tools")


def test_judge_reports_final_state_reasons():
    world = {"bank": {"accounts": {"b": 100.0}}}
    rubric = {
        "final_state": [{"kind": "balance", "account": "b", "amount": 120.0}],
        "items": [{"kind": "confirmed_result", "terms": [["120.00"]]}],
    }
    messages = [{"role": "assistant", "content": "Done, b holds 100.00 USD."}]
    verdict = judge(rubric, world, world, [], messages, finished=True)
    assert not verdict.kept
    assert verdict.reasons == [
        "final_state: balance of b is 100.0, expected 120.00",
        "confirmation: answer 1 does not state '120.00'",
    ]


# ------------------------------------------------------------------------------------------ factory and CLI


def test_factory_is_deterministic_and_renders(mcp_file):
    config = FactoryConfig(n=60, seed=2, tools_path=mcp_file, failure_rate=0.2, imperfection=0.3)
    first = generate(config)
    second = generate(config)
    assert first.kept == second.kept
    summary = first.summary
    assert summary["kept"] + summary["rejected"] == 60 and 0 < summary["kept"] < 60
    assert set(summary["rejected_by_reason"]) <= {
        "final_state",
        "unfinished",
        "confirmation",
        "unnecessary_question",
        "unnecessary_tool_call",
        "tool_on_no_tool_task",
    }
    assert any(record["domain"].startswith("mcp:") for record in first.kept)
    for record in first.kept:
        text = render_chat(record["messages"], tools=record["tools"], add_generation_prompt=False)
        assert parse_chat(text) == normalize_messages(record["messages"]) == record["messages"]


def test_cli_generate_end_to_end(tmp_path, mcp_file):
    out = tmp_path / "trajectories.jsonl"
    command = [
        sys.executable,
        "-m",
        "k2lab",
        "factory",
        "generate",
        "--n",
        "40",
        "--out",
        str(out),
        "--seed",
        "4",
        "--tools",
        str(mcp_file),
        "--failure-rate",
        "0.2",
        "--imperfection",
        "0.3",
        "--no-tool-fraction",
        "0.2",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "rejected by reason" in done.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads((tmp_path / "trajectories.summary.json").read_text())
    assert len(records) == summary["kept"] and summary["episodes"] == 40
    assert {"messages", "tools", "task_id", "domain", "needs_tools", "rubric"} <= set(records[0])
    assert any(not record["needs_tools"] for record in records)
    for record in records:
        text = render_chat(record["messages"], tools=record["tools"], add_generation_prompt=False)
        assert parse_chat(text) == record["messages"]
    with pytest.raises(SystemExit) as exit_info:  # in process: a second interpreter start costs seconds
        main(["factory", "generate", "--failure-rate", "2", "--out", str(tmp_path / "x.jsonl")])
    assert exit_info.value.code == 2 and not (tmp_path / "x.jsonl").exists()
    compact = tmp_path / "compact.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["factory", "generate", "--n", "20", "--variants-per-tool", "0", "--max-distractors", "0",
              "--out", str(compact)])  # fmt: skip
    assert exit_info.value.code in (0, None)
    canonical = {base.key for base in BASE_TOOLS}
    for line in compact.read_text().splitlines():
        record = json.loads(line)
        names = {tool["function"]["name"] for tool in record["tools"]}
        assert names <= canonical
        assert {BASES[name].domain for name in names} <= {record["domain"]}


def test_every_base_tool_is_reachable_by_some_task(env):
    planned = Counter()
    for seed in range(200):
        task = env.reset(seed).state["task"]
        planned.update(step["tool"] for phase in task["phases"] for step in phase["steps"])
    unplanned = {base.key for base in BASE_TOOLS} - set(planned)
    # read-only listing tools serve as distractors / unnecessary calls rather than plan steps
    assert unplanned <= {
        "search_products",
        "view_cart",
        "list_events",
        "list_accounts",
        "list_files",
        "list_skus",
    }


class _Stub:
    """A stand-in for ``openai.OpenAI``: ``chat.completions.create`` returns one canned message."""

    def __init__(self, message):
        self.chat = self
        self.completions = self
        self.message = message
        self.requests = []

    def create(self, **request):
        self.requests.append(request)
        choice = type("Choice", (), {"message": self.message})
        return type("Response", (), {"choices": [choice]})


def test_llm_backed_agent_and_user_speak_the_openai_protocol(env):
    from types import SimpleNamespace

    from k2lab.agentic.factory.experts import LLMAgent
    from k2lab.agentic.factory.tasks import LLMUserSimulator, Task

    episode = env.reset(1)
    name = episode.tools[0]["function"]["name"]
    call = SimpleNamespace(id="call_1", function=SimpleNamespace(name=name, arguments="{}"))
    agent = LLMAgent("k2", base_url="http://localhost:9/v1", temperature=0.0)
    agent.client = _Stub(SimpleNamespace(content=None, tool_calls=[call]))
    message = agent(episode)
    assert message["tool_calls"][0]["function"] == {"name": name, "arguments": "{}"}
    assert (
        agent.client.requests[0]["tools"] == episode.tools and agent.client.requests[0]["temperature"] == 0.0
    )
    env.step(episode, message)
    assert episode.messages[-1]["role"] == "tool" and episode.messages[-1]["tool_call_id"] == "call_1"
    user = LLMUserSimulator("user-model", base_url="http://localhost:9/v1")
    user.client = _Stub(SimpleNamespace(content="Sure, go ahead."))
    task = Task.from_dict(episode.state["task"])
    assert user.reply(task, 0, "Shall I?", False) == ("Sure, go ahead.", False)


def test_cli_generate_refuses_an_output_that_loses_a_file_before_any_work(
    tmp_path, mcp_file, monkeypatch, capsys
):
    """--n 0 emptied the output, -o equal to --tools replaced the input, and -o DIR failed with a traceback
    after every rollout: all refused (exit code 2) before generating, and every file is kept."""
    from k2lab.cli import agentic

    monkeypatch.setattr(agentic, "generate", lambda config: pytest.fail("generated before refusing"))
    keep = tmp_path / "keep.jsonl"
    keep.write_text('{"kept": true}\n')
    tools = tmp_path / "tools.jsonl"
    tools.write_text(mcp_file.read_text())
    cases = [
        (["--n", "0", "--out", keep], "greater than or equal to 1"),
        (["--n", "2", "--tools", tools, "--out", tools], "is also an input"),
        (["--n", "2", "--out", tmp_path], "is a directory"),
    ]
    for args, fragment in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["factory", "generate", *map(str, args)])
        assert exit_info.value.code == 2
        assert fragment in " ".join(capsys.readouterr().err.split())
    assert keep.read_text() == '{"kept": true}\n' and tools.read_text() == mcp_file.read_text()
    with pytest.raises(ValueError):
        FactoryConfig(n=0)
