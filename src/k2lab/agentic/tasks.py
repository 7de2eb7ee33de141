"""Agents, tool-matched tasks with explicit rubrics, user simulators and ``ToolTaskEnvironment``.

An **agent** is a domain, a system prompt (one of several styles) and a tool subset: one evolved variant of
every base tool of the domain plus a few distractors from other domains. A **task** is what a user wants
from that agent, in one or more **phases** (a follow-up request after the first answer makes it
multi-turn); a phase may hold back a detail (the quantity, the hour, the passenger) that the agent has to
ask for, and the user simulator answers from the task's hidden details. Each task carries its **plan**
(the canonical calls that solve it, run once on a copy of the world at generation time so every task is
feasible and its expected answers are known) and a **rubric**:

* final-state checks on the world (``order_placed``, ``cart_empty``, ``event_at``, ``event_absent``,
  ``balance``, ``file_contains``, ``file_absent``, ``stock``, ``shipment``, ``booking``, ``booking_absent``,
  ``unchanged``) and ``called`` (a call with exactly these canonical arguments was made: answers must be
  grounded in the right lookup);
* trajectory items: ``finished`` (answered before the turn limit), ``confirmed_result`` (the final answer
  names the key facts), ``no_unnecessary_questions``, ``only_needed_tools`` and, for no-tool tasks
  (chit-chat, questions answerable directly), ``no_tool_calls``.

``ToolTaskEnvironment`` runs such tasks behind ``k2lab.agentic.env.Environment``; ``k2lab.agentic.judge``
checks the rubric. The world, its initial copy, the task and a log of calls live in ``episode.state``.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from jsonschema import Draft202012Validator

from k2lab.agent.chat import tool_call_id
from k2lab.agentic.env import Environment, Episode
from k2lab.agentic.simulator import FailureRates, ToolSimulator, error_observation, invent_value
from k2lab.agentic.tools import (
    BASE_TOOLS,
    DAYS,
    DOMAINS,
    FULL_DAYS,
    SyntheticTool,
    ToolError,
    ToolRepository,
    build_repository,
    format_number,
    initial_world,
)

__all__ = [
    "Agent",
    "Clarification",
    "LLMUserSimulator",
    "Phase",
    "ScriptedUserSimulator",
    "Step",
    "Task",
    "TaskGenerator",
    "MINI_TOOLS",
    "ToolTaskEnvironment",
    "tool_env",
]

BASES = {base.key: base for base in BASE_TOOLS}
PERSONAS = ("Ava", "Milo", "Noor", "Kai", "Lena", "Ravi")
PROMPT_STYLES = (
    "You are {persona}, an assistant for {desc}. Use the tools to act on the user's behalf and confirm "
    "what you did.",
    "You help users with {desc}. Only call a tool when it is needed, and keep answers short.",
    "You are a concise operations agent for {desc}. Do not ask for information the user already gave; "
    "retry a tool when the service is briefly unavailable.",
    "System: {desc}. Act through the available functions. Report results plainly, with the numbers.",
)
TITLES = ("dentist", "team sync", "yoga", "1:1 with Sam", "budget review", "lunch with Mia")
PASSENGERS = ("Ada Lovelace", "Alan Turing", "Grace Hopper", "Katherine Johnson", "Edsger Dijkstra")
PHRASES = ("ship the beta on friday", "call the plumber", "remember the milk", "draft the Q3 report")
ADDRESSES = ("12 Elm St, Springfield", "4 Harbour Rd, Oslo", "77 Via Roma, Rome", "9 Rue Cler, Paris")


# ------------------------------------------------------------------------------------------- data types


@dataclass
class Clarification:
    """A detail the request holds back: the agent asks ``question``; a question with any of ``keywords``
    gets ``answer`` from the user simulator."""

    slot: str
    question: str
    keywords: list[str]
    answer: str


@dataclass
class Step:
    """One call of the plan: a base tool key (or an MCP tool name) and canonical arguments;
    ``expect_error`` is the ToolError kind the call is meant to hit (an edge-case task)."""

    tool: str
    args: dict[str, Any] = field(default_factory=dict)
    expect_error: str | None = None


@dataclass
class Phase:
    """One user request, the calls that serve it, and the answer that closes it."""

    request: str
    steps: list[Step] = field(default_factory=list)
    answer: str = ""
    clarification: Clarification | None = None
    terms: list[str] = field(default_factory=list)  # facts the answer must state (empty: taken from it)


@dataclass
class Agent:
    """A domain, a system prompt and tools: ``tools`` maps base key (or MCP name) -> tool name;
    ``distractors`` are tool names outside the domain."""

    agent_id: str
    domain: str
    system_prompt: str
    tools: dict[str, str]
    distractors: list[str] = field(default_factory=list)

    @property
    def tool_names(self) -> list[str]:
        return [*self.tools.values(), *self.distractors]


@dataclass
class Task:
    """A task for an agent: phases (with the plan), the rubric, and whether tools are needed at all."""

    task_id: str
    seed: int
    domain: str
    kind: str
    agent: Agent
    phases: list[Phase]
    rubric: dict[str, Any]
    needs_tools: bool = True
    max_turns: int = 8

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        data = copy.deepcopy(data)
        data["agent"] = Agent(**data["agent"])
        phases = []
        for phase in data["phases"]:
            clarification = phase.get("clarification")
            phase["clarification"] = Clarification(**clarification) if clarification else None
            phase["steps"] = [Step(**step) for step in phase["steps"]]
            phases.append(Phase(**phase))
        data["phases"] = phases
        return cls(**data)


@dataclass
class Draft:
    """A task template's output before the agent and rubric are attached."""

    kind: str
    phases: list[Phase]
    checks: list[dict[str, Any]]


# ---------------------------------------------------------------------------------------- templates


def _day_name(day: str) -> str:
    return FULL_DAYS[DAYS.index(day)].capitalize()


def _clarify(rng: random.Random, probability: float = 0.3) -> bool:
    return rng.random() < probability


def retail_order(rng: random.Random, world: dict[str, Any]) -> Draft:
    catalog = world["retail"]["catalog"]
    item = rng.choice(sorted(catalog))
    qty = rng.randint(1, min(4, catalog[item]["stock"]))
    total = round(catalog[item]["price"] * qty, 2)
    answer = f"Your order O-1001 is placed: {qty} x {item}, total {total:.2f} USD."
    steps = [Step("add_to_cart", {"item": item, "qty": qty}), Step("checkout")]
    if _clarify(rng):
        clarification = Clarification(
            "qty", f"How many {item} would you like?", ["how many", "quantity"], f"{qty}, please."
        )
        phase = Phase(f"I'd like to order some {item}. Please place the order.", steps, answer, clarification)
    else:
        phase = Phase(f"Please add {qty} {item} to my cart and place the order.", steps, answer)
    phases = [phase]
    if rng.random() < 0.35:
        phases.append(Phase("What did that come to in total?", [], f"It came to {total:.2f} USD."))
    checks = [
        {
            "kind": "order_placed",
            "items": {item: qty},
            "description": f"one new order with exactly {qty} {item}",
        },
        {"kind": "cart_empty", "description": "the cart is empty after checkout"},
    ]
    return Draft("retail_order", phases, checks)


def retail_basket(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Two products, then checkout: three dependent calls."""
    catalog = world["retail"]["catalog"]
    first, second = rng.sample(sorted(catalog), 2)
    items = {
        first: rng.randint(1, min(3, catalog[first]["stock"])),
        second: rng.randint(1, min(3, catalog[second]["stock"])),
    }
    total = round(sum(catalog[item]["price"] * qty for item, qty in items.items()), 2)
    steps = [Step("add_to_cart", {"item": item, "qty": qty}) for item, qty in items.items()] + [
        Step("checkout")
    ]
    listed = " and ".join(f"{qty} {item}" for item, qty in items.items())
    answer = f"Order O-1001 is placed: {listed}, total {total:.2f} USD."
    phase = Phase(f"Buy {listed} for me, please.", steps, answer, terms=["O-1001", f"{total:.2f}"])
    checks = [
        {"kind": "order_placed", "items": items, "description": f"one new order with exactly {listed}"},
        {"kind": "cart_empty", "description": "the cart is empty after checkout"},
    ]
    return Draft("retail_basket", [phase], checks)


def retail_remove(rng: random.Random, world: dict[str, Any]) -> Draft:
    keep, drop = rng.sample(sorted(world["retail"]["catalog"]), 2)
    world["retail"]["cart"] = {keep: 2, drop: 1}
    total = round(world["retail"]["catalog"][keep]["price"] * 2, 2)
    steps = [Step("remove_from_cart", {"item": drop}), Step("checkout")]
    answer = f"I removed the {drop} and placed order O-1001 for 2 x {keep}, total {total:.2f} USD."
    checks = [
        {"kind": "order_placed", "items": {keep: 2}, "description": f"one new order with exactly 2 {keep}"},
        {"kind": "cart_empty", "description": "the cart is empty after checkout"},
    ]
    return Draft(
        "retail_remove", [Phase(f"Take the {drop} out of my cart, then check out.", steps, answer)], checks
    )


def _free_slot(rng: random.Random, world: dict[str, Any]) -> tuple[str, int]:
    taken = {(e["day"], e["hour"]) for e in world["calendar"]["events"]}
    while True:
        slot = (rng.choice(DAYS), rng.randint(8, 18))
        if slot not in taken:
            return slot


def calendar_create(rng: random.Random, world: dict[str, Any]) -> Draft:
    title = rng.choice(TITLES)
    day, hour = _free_slot(rng, world)
    steps = [Step("create_event", {"title": title, "day": day, "hour": hour})]
    answer = f"Added '{title}' on {_day_name(day)} at {hour:02d}:00."
    if _clarify(rng):
        clarification = Clarification(
            "hour", "What time should it start?", ["time", "hour", "when"], f"At {hour:02d}:00."
        )
        phase = Phase(f"Add '{title}' to my calendar on {_day_name(day)}.", steps, answer, clarification)
    else:
        phase = Phase(f"Put '{title}' on my calendar for {_day_name(day)} at {hour:02d}:00.", steps, answer)
    check = {
        "kind": "event_at",
        "title": title,
        "day": day,
        "hour": hour,
        "description": f"'{title}' is on {day} at {hour}:00",
    }
    phases = [phase]
    if rng.random() < 0.35:
        others = sorted(e["title"] for e in world["calendar"]["events"] if e["day"] == day)
        listed = ", ".join(f"'{t}'" for t in [*others, title])
        follow = Phase(
            f"What's on my calendar that {_day_name(day)} now?",
            [Step("list_events", {"day": day})],
            f"On {_day_name(day)} you have: {listed}.",
            terms=[*others, title],
        )
        phases.append(follow)
    return Draft("calendar_create", phases, [check])


def calendar_move(rng: random.Random, world: dict[str, Any]) -> Draft:
    title = rng.choice(TITLES)
    old_day, old_hour = _free_slot(rng, world)
    world["calendar"]["events"].append({"title": title, "day": old_day, "hour": old_hour})
    day, hour = _free_slot(rng, world)
    steps = [Step("move_event", {"title": title, "day": day, "hour": hour})]
    answer = f"Moved '{title}' to {_day_name(day)} at {hour:02d}:00."
    request = f"Please move my '{title}' to {_day_name(day)} at {hour:02d}:00."
    check = {
        "kind": "event_at",
        "title": title,
        "day": day,
        "hour": hour,
        "description": f"'{title}' is on {day} at {hour}:00",
    }
    return Draft("calendar_move", [Phase(request, steps, answer)], [check])


def calendar_delete(rng: random.Random, world: dict[str, Any]) -> Draft:
    title = rng.choice(TITLES)
    day, hour = _free_slot(rng, world)
    world["calendar"]["events"].append({"title": title, "day": day, "hour": hour})
    steps = [Step("delete_event", {"title": title})]
    check = {"kind": "event_absent", "title": title, "description": f"no event titled '{title}' remains"}
    return Draft(
        "calendar_delete", [Phase(f"Cancel '{title}', please.", steps, f"Deleted '{title}'.")], [check]
    )


def bank_transfer(rng: random.Random, world: dict[str, Any]) -> Draft:
    accounts = world["bank"]["accounts"]
    source, target = rng.sample(sorted(accounts), 2)
    amount = float(rng.randrange(10, int(min(accounts[source], 500)), 5))
    after = {source: round(accounts[source] - amount, 2), target: round(accounts[target] + amount, 2)}
    steps = [Step("transfer", {"source": source, "target": target, "amount": amount})]
    answer = (
        f"Transferred {amount:.2f} USD from {source} to {target}; {source} now holds {after[source]:.2f} USD."
    )
    phases = [Phase(f"Transfer {amount:.2f} USD from my {source} account to {target}.", steps, answer)]
    if rng.random() < 0.35:
        follow = [Step("get_balance", {"account": target})]
        phases.append(
            Phase(
                f"And what's the balance of {target} now?",
                follow,
                f"{target} now holds {after[target]:.2f} USD.",
            )
        )
    checks = [
        {"kind": "balance", "account": name, "amount": value, "description": f"{name} holds {value:.2f} USD"}
        for name, value in after.items()
    ]
    return Draft("bank_transfer", phases, checks)


def bank_overdraft(rng: random.Random, world: dict[str, Any]) -> Draft:
    accounts = world["bank"]["accounts"]
    source, target = rng.sample(sorted(accounts), 2)
    amount = float(accounts[source] + rng.randrange(50, 500, 50))
    steps = [Step("transfer", {"source": source, "target": target, "amount": amount}, "insufficient_funds")]
    answer = (
        f"I couldn't make that transfer: insufficient funds, {source} holds only "
        f"{accounts[source]:.2f} USD. Nothing was moved."
    )
    phase = Phase(f"Send {amount:.2f} USD from {source} to {target}.", steps, answer)
    checks = [{"kind": "unchanged", "section": "bank", "description": "no money moved"}]
    return Draft("bank_overdraft", [phase], checks)


def bank_balance(rng: random.Random, world: dict[str, Any]) -> Draft:
    account = rng.choice(sorted(world["bank"]["accounts"]))
    value = world["bank"]["accounts"][account]
    steps = [Step("get_balance", {"account": account})]
    phase = Phase(
        f"How much money is in my {account} account?", steps, f"Your {account} account holds {value:.2f} USD."
    )
    return Draft(
        "bank_balance", [phase], [{"kind": "unchanged", "section": "bank", "description": "nothing moved"}]
    )


def bank_deposit(rng: random.Random, world: dict[str, Any]) -> Draft:
    account = rng.choice(sorted(world["bank"]["accounts"]))
    amount = float(rng.randrange(20, 300, 10))
    value = round(world["bank"]["accounts"][account] + amount, 2)
    steps = [Step("deposit", {"account": account, "amount": amount})]
    phase = Phase(
        f"Deposit {amount:.2f} USD into {account}.", steps, f"Done: {account} now holds {value:.2f} USD."
    )
    check = {
        "kind": "balance",
        "account": account,
        "amount": value,
        "description": f"{account} holds {value:.2f}",
    }
    return Draft("bank_deposit", [phase], [check])


def files_write(rng: random.Random, world: dict[str, Any]) -> Draft:
    path, text = rng.choice(("notes.txt", "plan.md", "ideas.txt", "report.txt")), rng.choice(PHRASES)
    steps = [Step("write_file", {"path": path, "text": text})]
    phases = [Phase(f"Create {path} containing: {text}", steps, f"Saved {path} with your text.")]
    if rng.random() < 0.35:
        names = sorted({*world["files"]["files"], path})
        phases.append(
            Phase(
                "Which files do I have now?",
                [Step("list_files")],
                f"Your files: {', '.join(names)}.",
                terms=names,
            )
        )
    check = {"kind": "file_contains", "path": path, "text": text, "description": f"{path} contains '{text}'"}
    return Draft("files_write", phases, [check])


def files_append(rng: random.Random, world: dict[str, Any]) -> Draft:
    text = "; " + rng.choice(PHRASES)
    original = world["files"]["files"]["todo.txt"]
    steps = [Step("append_file", {"path": "todo.txt", "text": text})]
    phase = Phase(
        f"Add '{text[2:]}' to the end of todo.txt, after a '; '.", steps, "Appended it to todo.txt."
    )
    check = {
        "kind": "file_contains",
        "path": "todo.txt",
        "text": original + text,
        "description": f"todo.txt reads '{original + text}'",
    }
    return Draft("files_append", [phase], [check])


def files_copy(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Read one file and write its text to another: the second call depends on the first's result."""
    text = rng.choice(PHRASES)
    world["files"]["files"]["readme.txt"] = text
    target = rng.choice(("backup.txt", "readme_copy.txt", "archive/readme.txt"))
    steps = [Step("read_file", {"path": "readme.txt"}), Step("write_file", {"path": target, "text": text})]
    phase = Phase(
        f"Make a copy of readme.txt at {target}.", steps, f"Copied readme.txt to {target}.", terms=[target]
    )
    check = {
        "kind": "file_contains",
        "path": target,
        "text": text,
        "description": f"{target} holds readme's text",
    }
    return Draft("files_copy", [phase], [check])


def files_read(rng: random.Random, world: dict[str, Any]) -> Draft:
    text = rng.choice(PHRASES)
    world["files"]["files"]["readme.txt"] = text
    steps = [Step("read_file", {"path": "readme.txt"})]
    phase = Phase("What does readme.txt say?", steps, f"readme.txt says: {text}", terms=[text])
    return Draft(
        "files_read", [phase], [{"kind": "unchanged", "section": "files", "description": "no file changed"}]
    )


def files_delete(rng: random.Random, world: dict[str, Any]) -> Draft:
    steps = [Step("delete_file", {"path": "todo.txt"})]
    phase = Phase("Delete todo.txt, I don't need it anymore.", steps, "Deleted todo.txt.")
    return Draft(
        "files_delete",
        [phase],
        [{"kind": "file_absent", "path": "todo.txt", "description": "todo.txt is gone"}],
    )


def math_calculate(rng: random.Random, world: dict[str, Any]) -> Draft:
    a, b, c = rng.randint(100, 9999), rng.randint(11, 999), rng.randint(2, 97)
    expression = rng.choice((f"({a} + {b}) * {c}", f"{a} * {b} - {c}", f"{a} / {c}", f"{a} * {c} + {b}"))
    value = format_number(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and operators only
    steps = [Step("calculate", {"expression": expression})]
    phase = Phase(f"Compute {expression} for me.", steps, f"{expression} = {value}", terms=[value])
    return Draft("math_calculate", [phase], [])


def math_convert(rng: random.Random, world: dict[str, Any]) -> Draft:
    source, target = rng.sample(("m", "km", "mi", "ft"), 2)
    value = float(rng.randint(2, 500))
    steps = [Step("convert_units", {"value": value, "from_unit": source, "to_unit": target})]
    result = BASES["convert_units"].impl(world, steps[0].args)["value"]
    phase = Phase(
        f"How many {target} is {format_number(value)} {source}?",
        steps,
        f"{format_number(value)} {source} is {format_number(result)} {target}.",
        terms=[format_number(result)],
    )
    return Draft("math_convert", [phase], [])


def math_statistics(rng: random.Random, world: dict[str, Any]) -> Draft:
    numbers = [float(rng.randint(1, 99)) for _ in range(rng.randint(4, 7))]
    op = rng.choice(("mean", "median", "max", "min", "sum"))
    steps = [Step("statistics", {"numbers": numbers, "op": op})]
    result = BASES["statistics"].impl(world, steps[0].args)["result"]
    listed = ", ".join(format_number(x) for x in numbers)
    phase = Phase(
        f"What is the {op} of {listed}?",
        steps,
        f"The {op} is {format_number(result)}.",
        terms=[format_number(result)],
    )
    return Draft("math_statistics", [phase], [])


def inventory_restock(rng: random.Random, world: dict[str, Any]) -> Draft:
    sku, qty = rng.choice(sorted(world["inventory"]["stock"])), rng.randint(5, 50)
    value = world["inventory"]["stock"][sku] + qty
    steps = [Step("restock", {"sku": sku, "qty": qty})]
    phase = Phase(
        f"We received {qty} units of {sku}; add them to stock.",
        steps,
        f"{sku} now has {value} units on hand.",
    )
    if rng.random() < 0.35:
        stock = {**world["inventory"]["stock"], sku: value}
        report = ", ".join(f"{k}: {v}" for k, v in sorted(stock.items()))
        follow = Phase(
            "Give me the full stock report.",
            [Step("list_skus")],
            f"Stock on hand: {report}.",
            terms=[f"{k}: {v}" for k, v in sorted(stock.items())],
        )
        return Draft(
            "inventory_restock",
            [phase, follow],
            [{"kind": "stock", "sku": sku, "qty": value, "description": f"{sku}: {value}"}],
        )
    return Draft(
        "inventory_restock",
        [phase],
        [{"kind": "stock", "sku": sku, "qty": value, "description": f"{sku}: {value}"}],
    )


def inventory_ship(rng: random.Random, world: dict[str, Any]) -> Draft:
    stock = world["inventory"]["stock"]
    sku = rng.choice(sorted(stock))
    stock[sku] = max(stock[sku], 5)
    qty, address = rng.randint(1, stock[sku]), rng.choice(ADDRESSES)
    steps = [Step("ship_order", {"sku": sku, "qty": qty, "address": address})]
    answer = f"Shipment S-501 of {qty} x {sku} is on its way to {address}."
    if _clarify(rng):
        clarification = Clarification(
            "address", "Where should I ship them?", ["where", "address"], f"To {address}."
        )
        phase = Phase(f"Ship {qty} units of {sku} to our customer.", steps, answer, clarification)
    else:
        phase = Phase(f"Ship {qty} units of {sku} to {address}.", steps, answer)
    checks = [
        {"kind": "stock", "sku": sku, "qty": stock[sku] - qty, "description": f"{sku}: {stock[sku] - qty}"},
        {
            "kind": "shipment",
            "sku": sku,
            "qty": qty,
            "address": address,
            "description": f"{qty} {sku} shipped",
        },
    ]
    return Draft("inventory_ship", [phase], checks)


def inventory_check(rng: random.Random, world: dict[str, Any]) -> Draft:
    sku = rng.choice(sorted(world["inventory"]["stock"]))
    value = world["inventory"]["stock"][sku]
    steps = [Step("check_stock", {"sku": sku})]
    phase = Phase(f"How many units of {sku} do we have?", steps, f"We have {value} units of {sku} on hand.")
    return Draft(
        "inventory_check",
        [phase],
        [{"kind": "unchanged", "section": "inventory", "description": "no change"}],
    )


def travel_book(rng: random.Random, world: dict[str, Any]) -> Draft:
    flight = rng.choice(world["travel"]["flights"])
    flight["seats"] = max(flight["seats"], 1)
    passenger = rng.choice(PASSENGERS)
    route = f"from {flight['origin']} to {flight['destination']} on {_day_name(flight['day'])}"
    steps = [
        Step(
            "search_flights",
            {"origin": flight["origin"], "destination": flight["destination"], "day": flight["day"]},
        ),
        Step("book_flight", {"flight_id": flight["id"], "passenger": passenger}),
    ]
    answer = f"{passenger} is booked on {flight['id']} {route}; booking B-301."
    if _clarify(rng):
        clarification = Clarification(
            "passenger", "What is the passenger's full name?", ["name", "passenger"], f"It's {passenger}."
        )
        phase = Phase(f"Book a seat on the flight {route}.", steps, answer, clarification)
    else:
        phase = Phase(f"Book {passenger} on the flight {route}.", steps, answer)
    check = {
        "kind": "booking",
        "flight_id": flight["id"],
        "passenger": passenger,
        "description": f"{passenger} is booked on {flight['id']}",
    }
    return Draft("travel_book", [phase], [check])


def travel_cancel(rng: random.Random, world: dict[str, Any]) -> Draft:
    flight = rng.choice(world["travel"]["flights"])
    world["travel"]["bookings"].append({"booking_id": "B-300", "flight_id": flight["id"], "passenger": "you"})
    steps = [Step("cancel_booking", {"booking_id": "B-300"})]
    phase = Phase("Please cancel my booking B-300.", steps, "Booking B-300 is cancelled.")
    check = {"kind": "booking_absent", "booking_id": "B-300", "description": "booking B-300 no longer exists"}
    return Draft("travel_cancel", [phase], [check])


TEMPLATES: dict[str, tuple[Callable[[random.Random, dict[str, Any]], Draft], ...]] = {
    "retail": (retail_order, retail_order, retail_basket, retail_remove),
    "calendar": (calendar_create, calendar_create, calendar_move, calendar_delete),
    "bank": (bank_transfer, bank_transfer, bank_overdraft, bank_balance, bank_deposit),
    "files": (files_write, files_append, files_copy, files_read, files_delete),
    "math": (math_calculate, math_convert, math_statistics),
    "inventory": (inventory_restock, inventory_ship, inventory_check),
    "travel": (travel_book, travel_book, travel_cancel),
}

NO_TOOL_PROMPTS = (
    (
        "Hi there! How's your day going?",
        "Hi! Doing well, thanks for asking. I'm here whenever you need help.",
    ),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("How many days are in a week?", "A week has 7 days."),
    ("What is 2 + 2?", "2 + 2 is 4."),
    ("How many minutes are in an hour?", "An hour has 60 minutes."),
    ("Thanks, that's all for today!", "You're welcome, have a great day!"),
    ("Spell the word 'cat' backwards.", "Backwards, 'cat' is 'tac'."),
    ("At what temperature in Celsius does water boil at sea level?", "Water boils at 100 degrees Celsius."),
)
NO_TOOL_TERMS = ("thanks", "Paris", "7", "4", "60", "welcome", "tac", "100")


def no_tool_task(rng: random.Random, world: dict[str, Any]) -> Draft:
    index = rng.randrange(len(NO_TOOL_PROMPTS))
    request, answer = NO_TOOL_PROMPTS[index]
    terms = [NO_TOOL_TERMS[index]]
    phase = Phase(request, [], answer, terms=terms)
    return Draft("no_tool", [phase], [{"kind": "unchanged", "description": "nothing changed"}])


# ---------------------------------------------------------------------------------------- generation


class TaskGenerator:
    """Deterministic tasks (by seed) for agents sampled over a repository's domains and MCP tools."""

    def __init__(
        self,
        repository: ToolRepository,
        no_tool_fraction: float = 0.15,
        mcp_fraction: float = 0.2,
        max_distractors: int = 2,
        domains: Sequence[str] | None = None,
    ):
        self.repository = repository
        self.no_tool_fraction = no_tool_fraction
        self.mcp_fraction = mcp_fraction if repository.mcp else 0.0
        self.max_distractors = max_distractors
        self.tree = repository.by_domain()
        self.domains = sorted(domains or DOMAINS)
        unknown = sorted(set(self.domains) - set(DOMAINS))
        if unknown:
            raise ValueError(f"unknown tool domains {unknown}; choose from {', '.join(sorted(DOMAINS))}")

    def sample_agent(self, rng: random.Random, domain: str) -> Agent:
        """One variant per base tool of ``domain`` and up to ``max_distractors`` tools of other domains."""
        tools = {key: rng.choice(variants).name for key, variants in sorted(self.tree[domain].items())}
        others = sorted(name for name, tool in self.repository.synthetic.items() if tool.domain != domain)
        distractors = rng.sample(others, rng.randint(0, self.max_distractors))
        style = rng.choice(PROMPT_STYLES)
        prompt = style.format(persona=rng.choice(PERSONAS), desc=DOMAINS[domain])
        return Agent(f"{domain}-{rng.randrange(10**6):06d}", domain, prompt, tools, distractors)

    def generate(self, seed: int) -> tuple[Task, dict[str, Any]]:
        """The task for ``seed`` and its initial world."""
        rng = random.Random(f"task:{seed}")
        world = initial_world(rng)
        domain = rng.choice(self.domains)
        agent = self.sample_agent(rng, domain)
        draw = rng.random()
        if draw < self.no_tool_fraction:
            return self._finish(seed, agent, no_tool_task(rng, world), world, needs_tools=False)
        if draw < self.no_tool_fraction + self.mcp_fraction:
            mcp = self._mcp_task(rng, seed, world)
            if mcp is not None:
                return mcp
        draft = rng.choice(TEMPLATES[domain])(rng, world)
        return self._finish(seed, agent, draft, world)

    def _finish(
        self, seed: int, agent: Agent, draft: Draft, world: dict[str, Any], needs_tools: bool = True
    ) -> tuple[Task, dict[str, Any]]:
        _rehearse(draft, world, agent)
        rubric = _rubric(draft, agent, needs_tools)
        steps = sum(len(phase.steps) for phase in draft.phases)
        task = Task(
            f"{draft.kind}-{seed}",
            seed,
            agent.domain,
            draft.kind,
            agent,
            draft.phases,
            rubric,
            needs_tools,
            max_turns=4 + 5 * steps + 2 * len(draft.phases),
        )
        return task, world

    def _mcp_task(self, rng: random.Random, seed: int, world: dict[str, Any]) -> tuple[Task, dict] | None:
        """A task for a harvested tool: call it with given arguments and report back (None if no
        schema-valid arguments could be invented)."""
        names = sorted(self.repository.mcp)
        name = rng.choice(names)
        record = self.repository.mcp[name]
        schema = record["openai"]["function"].get("parameters") or {"type": "object", "properties": {}}
        args = invent_value({**schema, "properties": _required_only(schema)}, rng) or {}
        if list(Draft202012Validator(schema).iter_errors(args)):
            return None
        server = record.get("server") or "mcp"
        same = [
            n for n in names if n != name and self.repository.mcp[n].get("server") == record.get("server")
        ]
        extra = rng.sample(same, min(len(same), rng.randint(0, 2)))
        prompt = rng.choice(PROMPT_STYLES).format(persona=rng.choice(PERSONAS), desc=f"the {server} tools")
        agent = Agent(f"mcp-{rng.randrange(10**6):06d}", f"mcp:{server}", prompt, {name: name}, extra)
        shown = ", ".join(f"{key}={json.dumps(value)}" for key, value in args.items()) or "no arguments"
        phase = Phase(
            f"Please run {name} with {shown} and tell me when it is done.",
            [Step(name, args)],
            f"Done: {name} completed successfully.",
        )
        draft = Draft("mcp_call", [phase], [])
        return self._finish(seed, agent, draft, world)


def _required_only(schema: dict[str, Any]) -> dict[str, Any]:
    required = set(schema.get("required") or [])
    return {key: sub for key, sub in (schema.get("properties") or {}).items() if key in required}


def _rehearse(draft: Draft, world: dict[str, Any], agent: Agent) -> None:
    """Run the plan on a copy of the world with the canonical semantics: every step must succeed (or fail
    with its ``expect_error``), so generated tasks are feasible."""
    scratch = copy.deepcopy(world)
    for phase in draft.phases:
        for step in phase.steps:
            if step.tool not in BASES:
                continue
            try:
                BASES[step.tool].impl(scratch, copy.deepcopy(step.args))
            except ToolError as error:
                if error.kind != step.expect_error:
                    raise RuntimeError(f"infeasible task {draft.kind}: {error}") from error
            else:
                if step.expect_error:
                    raise RuntimeError(f"task {draft.kind} expected {step.expect_error}")


def _rubric(draft: Draft, agent: Agent, needs_tools: bool) -> dict[str, Any]:
    """Final-state checks (with ``called`` checks for every planned call) and trajectory items."""
    checks = list(draft.checks)
    for phase in draft.phases:
        for step in phase.steps:
            outcome = step.expect_error or "ok"
            checks.append(
                {
                    "kind": "called",
                    "tool": agent.tools[step.tool],
                    "args": step.args,
                    "outcome": outcome,
                    "description": f"{step.tool} was called with {json.dumps(step.args)} ({outcome})",
                }
            )
    questions = sum(phase.clarification is not None for phase in draft.phases)
    items: list[dict[str, Any]] = [
        {"kind": "finished", "description": "the assistant answered before the turn limit"},
        {
            "kind": "confirmed_result",
            "terms": [_key_terms(draft, i) for i in range(len(draft.phases))],
            "description": "each final answer confirms the result with its key facts",
        },
        {
            "kind": "no_unnecessary_questions",
            "max_questions": questions,
            "description": f"asked at most {questions} clarifying question(s)",
        },
    ]
    if needs_tools:
        allowed = sorted({agent.tools[step.tool] for phase in draft.phases for step in phase.steps})
        items.append(
            {"kind": "only_needed_tools", "allowed": allowed, "description": "called only needed tools"}
        )
    else:
        items.append({"kind": "no_tool_calls", "description": "answered directly without calling a tool"})
    return {"final_state": checks, "items": items}


def _key_terms(draft: Draft, index: int) -> list[str]:
    """Facts the phase's final answer must state: numbers, ids and names found in the expected answer."""
    phase = draft.phases[index]
    if phase.terms:
        return list(phase.terms)
    answer = phase.answer
    words = [word.strip(".,;:'!?") for word in answer.split()]
    facts = [w for w in words if any(ch.isdigit() for ch in w) or "-" in w or "." in w[1:-1]]
    return facts[:3] or [words[1]]


# ------------------------------------------------------------------------------------------ users


class ScriptedUserSimulator:
    """Answers the agent's questions from the task's hidden details; other questions get a go-ahead."""

    def reply(self, task: Task, phase: int, question: str, clarified: bool) -> tuple[str, bool]:
        """``(text, clarified)``: the user's reply and whether it gave the phase's held-back detail."""
        clarification = task.phases[phase].clarification
        lowered = question.lower()
        if clarification and not clarified and any(word in lowered for word in clarification.keywords):
            return clarification.answer, True
        return "Yes, please go ahead.", clarified


class LLMUserSimulator:
    """A user played by a model behind an OpenAI-compatible endpoint (``openai`` client, any
    ``base_url``); it knows the task's hidden details. Optional: the factory's default is scripted."""

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None):
        from openai import OpenAI

        self.model = model
        self.client = OpenAI(base_url=base_url, api_key=api_key or "EMPTY")

    def reply(self, task: Task, phase: int, question: str, clarified: bool) -> tuple[str, bool]:
        clarification = task.phases[phase].clarification
        hidden = f" If asked, the missing detail is: {clarification.answer}" if clarification else ""
        system = (
            f"You are a user who asked an assistant: {task.phases[phase].request!r}.{hidden} "
            "Answer the assistant's question in one short sentence; never ask anything back."
        )
        response = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=64,
        )
        text = (response.choices[0].message.content or "").strip() or "Yes, please go ahead."
        gave = bool(clarification) and clarification.answer.rstrip(".").lower() in text.lower()
        return text, clarified or gave


# ------------------------------------------------------------------------------------------ environment


#: How a failed tool task earns partial credit (``ToolTaskEnvironment(credit=...)``).
CREDITS = ("checks", "progress")


def check_credit(credit: str) -> None:
    """Raise ``ValueError`` unless ``credit`` is one of ``CREDITS``."""
    if credit not in CREDITS:
        raise ValueError(f"credit must be one of {', '.join(CREDITS)}, got {credit!r}")


class ToolTaskEnvironment(Environment):
    """The factory's tool tasks behind the ``Environment`` interface (see the module docstring).

    ``step`` appends the assistant message, runs its tool calls in the simulator (appending ``role: tool``
    messages with the call's ``tool_call_id``), answers a question (a text-only turn ending in ``?``) with
    the user simulator, moves to the next phase's request after an answer, and judges the episode when the
    last phase is answered or ``max_turns`` is reached.

    ``domains`` restricts the tasks to some of the repository's domains, ``max_turns`` caps every task's
    turn limit. The reward is 1 for a trajectory that meets its whole rubric; otherwise ``partial_credit`` times
    (``credit``) the fraction of rubric checks it meets (``"checks"``) or the share of the reference solution it
    reproduced (``"progress"``: planned calls graded by their arguments and the answer's key facts,
    ``k2lab.agentic.judge.solution_progress``; nothing for what doing nothing satisfies). The default partial
    credit of 0 rewards success only. A partial credit below 1 keeps every success above every failure while
    giving RL groups whose members all fail a signal to rank them by.
    """

    name = "tool_tasks"

    def __init__(
        self,
        repository: ToolRepository | None = None,
        rates: FailureRates | None = None,
        no_tool_fraction: float = 0.15,
        mcp_fraction: float = 0.2,
        user: ScriptedUserSimulator | LLMUserSimulator | None = None,
        max_distractors: int = 2,
        partial_credit: float = 0.0,
        domains: Sequence[str] | None = None,
        max_turns: int | None = None,
        credit: str = "checks",
    ):
        if not 0.0 <= partial_credit < 1.0:
            raise ValueError(f"partial_credit must be in [0, 1), got {partial_credit}")
        check_credit(credit)
        self.repository = repository or build_repository()
        self.simulator = ToolSimulator(self.repository, rates)
        self.generator = TaskGenerator(
            self.repository, no_tool_fraction, mcp_fraction, max_distractors, domains
        )
        self.user = user or ScriptedUserSimulator()
        self.partial_credit, self.max_turns, self.credit = partial_credit, max_turns, credit

    def reset(self, seed: int) -> Episode:
        task, world = self.generator.generate(seed)
        tools = [self.repository.spec(name) for name in task.agent.tool_names]
        messages = [
            {"role": "system", "content": task.agent.system_prompt},
            {"role": "user", "content": task.phases[0].request},
        ]
        state = {
            "world": world,
            "initial": copy.deepcopy(world),
            "task": task.to_dict(),
            "phase": 0,
            "phase_start": 1,
            "clarified": False,
            "calls": [],
        }
        return Episode(
            self.name,
            seed,
            task.task_id,
            messages,
            tools,
            state,
            task.max_turns if self.max_turns is None else min(task.max_turns, self.max_turns),
            needs_tools=task.needs_tools,
        )

    def step(self, episode: Episode, message: dict[str, Any]) -> None:
        if episode.done:
            return
        if not isinstance(message, dict):
            episode.messages.append({"role": "assistant", "content": str(message)})
            self._finish(episode, finished=False, reason="malformed message")
            return
        calls = message.get("tool_calls") or []
        clean = {"role": "assistant", "content": message.get("content")}
        if message.get("reasoning_content") is not None:
            clean["reasoning_content"] = message["reasoning_content"]
        if not isinstance(calls, list):
            episode.messages.append(clean)
            self._finish(episode, finished=False, reason="malformed tool call")
            return
        episode.turns += 1
        if calls:
            self._run_calls(episode, clean, calls)
            if episode.turns >= episode.max_turns:
                self._finish(episode, finished=False, reason="max turns")
            return
        episode.messages.append(clean)
        self._answer(episode, str(message.get("content") or ""))

    def _run_calls(self, episode: Episode, clean: dict[str, Any], calls: list[Any]) -> None:
        clean["tool_calls"] = []
        results = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            call_id = call.get("id") if isinstance(call, dict) else None
            call_id = (
                call_id
                if isinstance(call_id, str) and call_id
                else tool_call_id(str(name), episode.tool_calls)
            )
            index = episode.tool_calls
            episode.tool_calls += 1
            if not isinstance(name, str):
                observation = error_observation("malformed_call", "a tool call needs a function with a name")
            else:
                observation = self.simulator.execute(
                    episode.state["world"], name, arguments, episode.seed, index
                )
            clean["tool_calls"].append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": str(name), "arguments": _as_text(arguments)},
                }
            )
            results.append({"role": "tool", "tool_call_id": call_id, "content": observation.content})
            episode.state["calls"].append(self._log(name, arguments, observation.kind, observation.ok))
        episode.messages.append(clean)
        episode.messages.extend(results)

    def _log(self, name: Any, arguments: Any, kind: str, ok: bool) -> dict[str, Any]:
        """A call as the judge sees it: tool name, canonical arguments (when decodable), outcome kind."""
        tool: SyntheticTool | None = self.repository.synthetic.get(name) if isinstance(name, str) else None
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else dict(arguments or {})
        except (ValueError, TypeError):
            parsed = None
        canonical = tool.decode(parsed) if tool is not None and isinstance(parsed, dict) else parsed
        return {"tool": name, "args": canonical, "kind": kind, "ok": ok}

    def _answer(self, episode: Episode, text: str) -> None:
        task = Task.from_dict(episode.state["task"])
        state = episode.state
        if text.rstrip().endswith("?") and episode.turns < episode.max_turns:
            reply, state["clarified"] = self.user.reply(task, state["phase"], text, state["clarified"])
            episode.messages.append({"role": "user", "content": reply})
            return
        if episode.turns >= episode.max_turns and text.rstrip().endswith("?"):
            self._finish(episode, finished=False, reason="max turns")
            return
        state.setdefault("answers", []).append(text)
        if state["phase"] + 1 < len(task.phases) and episode.turns < episode.max_turns:
            state["phase"] += 1
            state["clarified"] = False
            episode.messages.append({"role": "user", "content": task.phases[state["phase"]].request})
            state["phase_start"] = len(episode.messages) - 1
            return
        self._finish(episode, finished=state["phase"] + 1 == len(task.phases), reason="answered")

    def _finish(self, episode: Episode, finished: bool, reason: str) -> None:
        from k2lab.agentic.judge import judge_episode

        verdict = judge_episode(episode, finished=finished)
        outcome = (
            "solved" if verdict.kept else (verdict.reasons[0].split(":")[0] if verdict.reasons else reason)
        )
        if self.credit == "progress":
            met = verdict.progress
        else:
            met = sum(bool(check.get("ok")) for check in verdict.checks) / max(1, len(verdict.checks))
        reward = 1.0 if verdict.kept else self.partial_credit * met
        episode.finish(
            verdict.kept,
            outcome,
            reward=reward,
            ended=reason,
            reasons=verdict.reasons,
            checks=verdict.checks,
            progress=round(verdict.progress, 6),
        )


#: The agentic-mini curriculum (``k2lab recipe agentic-mini``, ``mini-tools`` environments): canonical tool
#: names only (no evolved variants), at most one distractor per agent, at most 8 turns, and partial credit
#: for RL, so that a ~20M-parameter model can learn the tasks on a CPU.
MINI_TOOLS: dict[str, Any] = {
    "variants_per_tool": 0,
    "max_distractors": 1,
    "max_turns": 8,
    "partial_credit": 0.5,
}


def tool_env(name: str) -> ToolTaskEnvironment:
    """The environment named ``tools[:DOMAIN]`` (the full repository: 12 evolved variants of every base tool,
    up to 2 distractors) or ``mini-tools[:DOMAIN]`` (the ``MINI_TOOLS`` curriculum); ``DOMAIN`` restricts the
    tasks to one domain (``retail``, ``calendar``, ``bank``, ``files``, ``math``, ``inventory``, ``travel``)."""
    kind, _, domain = name.partition(":")
    domains = [domain] if domain else None
    if kind in ("tools", "tool_tasks"):
        return ToolTaskEnvironment(domains=domains)
    if kind == "mini-tools":
        mini = MINI_TOOLS
        return ToolTaskEnvironment(
            build_repository(0, mini["variants_per_tool"]),
            max_distractors=mini["max_distractors"],
            partial_credit=mini["partial_credit"],
            domains=domains,
            max_turns=mini["max_turns"],
        )
    raise ValueError(f"unknown tool environment {name!r}: use tools[:DOMAIN] or mini-tools[:DOMAIN]")


def _as_text(arguments: Any) -> str:
    """Arguments as the JSON text the conversation records."""
    if isinstance(arguments, str):
        return arguments
    try:
        return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(str(arguments))
