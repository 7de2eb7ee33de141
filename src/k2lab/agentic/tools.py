"""The data factory's tool repository: harvested MCP specs plus synthetic tools evolved over domains.

Synthetic tools live in a hierarchy ``domain -> family -> base tool -> evolved variants``. A base tool has
canonical parameters and **stateful semantics in Python** (``impl(world, canonical_args)``) acting on the
episode's world state (one JSON-able dict with a section per domain, see ``initial_world``). ``evolve``
derives variants procedurally and deterministically from a seed: another name, renamed parameters, extra
optional (ignored) fields, other units or enum spellings (money in cents, hours as minutes of the day, days
as full names or indices, unit names spelled out). A variant converts its arguments back to the canonical
ones (``decode``) before running the base semantics, so every variant behaves the same on the world; an
agent that knows what it wants to do in canonical terms writes a variant's call with ``encode``.

Domain errors (unknown item, insufficient funds, calendar conflict ...) raise ``ToolError`` with a ``kind``.
Results are JSON-able dicts in canonical units (money in dollars, labelled ``currency``).

Harvested MCP tools (the JSONL of ``k2lab tools harvest``) are spec-only: the simulator invents
schema-conforming results for them.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k2lab.agent.tool_spec import validate_tool
from k2lab.errors import K2LabError

__all__ = [
    "BASE_TOOLS",
    "DAYS",
    "DOMAINS",
    "BaseTool",
    "Codec",
    "Param",
    "SyntheticTool",
    "ToolError",
    "ToolRepository",
    "build_repository",
    "evolve",
    "initial_world",
    "load_mcp_tools",
    "safe_calculate",
]

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
FULL_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
LENGTH_UNITS = {"m": 1.0, "km": 1000.0, "mi": 1609.344, "ft": 0.3048}
LONG_UNIT_NAMES = {"m": "meters", "km": "kilometers", "mi": "miles", "ft": "feet"}
ITEMS = {"apple": 0.5, "banana": 0.25, "coffee": 7.5, "bread": 3.0, "milk": 1.2, "cheese": 5.75, "eggs": 2.4}
SKUS = ("SKU-100", "SKU-200", "SKU-300", "SKU-400", "SKU-500")
CITIES = ("Berlin", "Paris", "Rome", "Madrid", "Vienna", "Oslo")
ACCOUNTS = ("checking", "savings", "travel", "rent")


class ToolError(K2LabError):
    """A domain error of a tool call (``kind``: ``unknown_item``, ``insufficient_funds``, ...)."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(message)


# ----------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Codec:
    """How a variant writes one canonical value: ``identity``, ``scale`` (exposed = canonical * factor,
    e.g. cents) or ``enum`` (a mapping of canonical values to exposed ones)."""

    kind: str = "identity"
    factor: float = 1.0
    mapping: tuple[tuple[Any, Any], ...] = ()
    schema: tuple[tuple[str, Any], ...] = ()  # overrides of the parameter's JSON schema
    note: str = ""

    def encode(self, value: Any) -> Any:
        """The exposed value of a canonical one."""
        if self.kind == "scale" and isinstance(value, int | float):
            scaled = value * self.factor
            return int(round(scaled)) if dict(self.schema).get("type") == "integer" else scaled
        if self.kind == "enum":
            return dict(self.mapping).get(value, value)
        return value

    def decode(self, value: Any) -> Any:
        """The canonical value of an exposed one."""
        if self.kind == "scale" and isinstance(value, int | float) and not isinstance(value, bool):
            return round(value / self.factor, 6)
        if self.kind == "enum":
            return {exposed: canonical for canonical, exposed in self.mapping}.get(value, value)
        return value


IDENTITY = Codec()


@dataclass(frozen=True)
class Param:
    """A canonical parameter: its JSON schema, whether it is required, and its ``kind`` (which decides the
    unit / enum variants evolution may choose: ``money``, ``day``, ``hour``, ``unit`` or ``plain``)."""

    name: str
    schema: dict[str, Any]
    required: bool = True
    kind: str = "plain"


@dataclass(frozen=True)
class BaseTool:
    """A tool's canonical form: domain, family, description, parameters and semantics."""

    key: str
    domain: str
    family: str
    description: str
    params: tuple[Param, ...]
    impl: Callable[[dict[str, Any], dict[str, Any]], Any]
    read_only: bool = False
    list_key: str | None = None  # the result's list (partial / empty results truncate it)
    aliases: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------- the world


def initial_world(rng: random.Random) -> dict[str, Any]:
    """A fresh world with one section per domain, randomised by ``rng``."""
    items = rng.sample(sorted(ITEMS), 5)
    catalog = {item: {"price": ITEMS[item], "stock": rng.randint(5, 20)} for item in items}
    balances = rng.sample(range(50, 2000, 10), len(ACCOUNTS))
    flights = []
    for number in range(8):
        origin, destination = rng.sample(CITIES, 2)
        flights.append(
            {
                "id": f"FL{100 + number * 7 + rng.randint(0, 6)}",
                "origin": origin,
                "destination": destination,
                "day": rng.choice(DAYS),
                "price": float(rng.randrange(60, 400, 5)),
                "seats": rng.randint(1, 9),
            }
        )
    return {
        "retail": {"catalog": catalog, "cart": {}, "orders": []},
        "calendar": {"events": [{"title": "standup", "day": "mon", "hour": 9}]},
        "bank": {"accounts": {a: float(b) for a, b in zip(ACCOUNTS, balances, strict=True)}, "transfers": []},
        "files": {"files": {"readme.txt": "hello", "todo.txt": "buy milk"}},
        "math": {"history": []},
        "inventory": {"stock": {sku: rng.randint(0, 40) for sku in SKUS}, "shipments": []},
        "travel": {"flights": _unique_flights(flights), "bookings": []},
    }


def _unique_flights(flights: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop flights whose id or (origin, destination, day) repeats an earlier one."""
    seen_ids, seen_routes, out = set(), set(), []
    for flight in flights:
        route = (flight["origin"], flight["destination"], flight["day"])
        if flight["id"] not in seen_ids and route not in seen_routes:
            seen_ids.add(flight["id"])
            seen_routes.add(route)
            out.append(flight)
    return out


def _money(value: float) -> float:
    return round(float(value), 2)


# --------------------------------------------------------------------------------------------- retail


def _catalog_item(world: dict[str, Any], item: str) -> dict[str, Any]:
    catalog = world["retail"]["catalog"]
    if item not in catalog:
        raise ToolError(
            "unknown_item", f"unknown item {item!r}; the store sells {', '.join(sorted(catalog))}"
        )
    return catalog[item]


def search_products(world: dict[str, Any], args: dict[str, Any]) -> Any:
    query = str(args.get("query", "")).lower()
    catalog = world["retail"]["catalog"]
    found = [{"item": k, "price": v["price"], "stock": v["stock"]} for k, v in catalog.items() if query in k]
    return {"products": found, "currency": "USD"}


def add_to_cart(world: dict[str, Any], args: dict[str, Any]) -> Any:
    item, qty = args["item"], int(args["qty"])
    entry = _catalog_item(world, item)
    cart = world["retail"]["cart"]
    if qty < 1:
        raise ToolError("invalid_quantity", "quantity must be at least 1")
    if cart.get(item, 0) + qty > entry["stock"]:
        raise ToolError("out_of_stock", f"only {entry['stock']} {item} in stock")
    cart[item] = cart.get(item, 0) + qty
    return {"cart": dict(cart)}


def remove_from_cart(world: dict[str, Any], args: dict[str, Any]) -> Any:
    item = args["item"]
    cart = world["retail"]["cart"]
    if item not in cart:
        raise ToolError("not_in_cart", f"{item!r} is not in the cart")
    qty = int(args.get("qty") or cart[item])
    cart[item] -= min(qty, cart[item])
    if cart[item] <= 0:
        del cart[item]
    return {"cart": dict(cart)}


def _cart_total(world: dict[str, Any]) -> float:
    catalog = world["retail"]["catalog"]
    return _money(sum(catalog[item]["price"] * qty for item, qty in world["retail"]["cart"].items()))


def view_cart(world: dict[str, Any], args: dict[str, Any]) -> Any:
    catalog = world["retail"]["catalog"]
    items = [{"item": k, "qty": q, "price": catalog[k]["price"]} for k, q in world["retail"]["cart"].items()]
    return {"items": items, "total": _cart_total(world), "currency": "USD"}


def checkout(world: dict[str, Any], args: dict[str, Any]) -> Any:
    retail = world["retail"]
    if not retail["cart"]:
        raise ToolError("empty_cart", "the cart is empty")
    order = {"order_id": f"O-{1001 + len(retail['orders'])}", "items": dict(retail["cart"])}
    order["total"] = _cart_total(world)
    for item, qty in retail["cart"].items():
        retail["catalog"][item]["stock"] -= qty
    retail["orders"].append(order)
    retail["cart"] = {}
    return {**order, "status": "placed", "currency": "USD"}


# ------------------------------------------------------------------------------------------- calendar


def _find_event(world: dict[str, Any], title: str) -> dict[str, Any]:
    for event in world["calendar"]["events"]:
        if event["title"] == title:
            return event
    raise ToolError("unknown_event", f"no event titled {title!r}")


def _check_slot(world: dict[str, Any], day: str, hour: int, ignore: str | None = None) -> None:
    if day not in DAYS:
        raise ToolError("invalid_day", f"unknown day {day!r}")
    if not 0 <= hour <= 23:
        raise ToolError("invalid_hour", f"hour {hour} is outside 0-23")
    for event in world["calendar"]["events"]:
        if event["day"] == day and event["hour"] == hour and event["title"] != ignore:
            raise ToolError("conflict", f"{day} {hour}:00 is taken by {event['title']!r}")


def create_event(world: dict[str, Any], args: dict[str, Any]) -> Any:
    title, day, hour = args["title"], args["day"], int(args["hour"])
    if any(event["title"] == title for event in world["calendar"]["events"]):
        raise ToolError("duplicate_event", f"an event titled {title!r} exists already")
    _check_slot(world, day, hour)
    event = {"title": title, "day": day, "hour": hour}
    world["calendar"]["events"].append(event)
    return {"created": dict(event)}


def list_events(world: dict[str, Any], args: dict[str, Any]) -> Any:
    day = args.get("day")
    return {"events": [dict(e) for e in world["calendar"]["events"] if day in (None, e["day"])]}


def delete_event(world: dict[str, Any], args: dict[str, Any]) -> Any:
    event = _find_event(world, args["title"])
    world["calendar"]["events"].remove(event)
    return {"deleted": dict(event)}


def move_event(world: dict[str, Any], args: dict[str, Any]) -> Any:
    event = _find_event(world, args["title"])
    day, hour = args["day"], int(args["hour"])
    _check_slot(world, day, hour, ignore=event["title"])
    event.update(day=day, hour=hour)
    return {"moved": dict(event)}


# ----------------------------------------------------------------------------------------------- bank


def _account(world: dict[str, Any], name: str) -> float:
    accounts = world["bank"]["accounts"]
    if name not in accounts:
        raise ToolError("unknown_account", f"unknown account {name!r}")
    return accounts[name]


def list_accounts(world: dict[str, Any], args: dict[str, Any]) -> Any:
    return {"accounts": sorted(world["bank"]["accounts"]), "currency": "USD"}


def get_balance(world: dict[str, Any], args: dict[str, Any]) -> Any:
    return {"account": args["account"], "balance": _account(world, args["account"]), "currency": "USD"}


def transfer(world: dict[str, Any], args: dict[str, Any]) -> Any:
    source, target, amount = args["source"], args["target"], _money(args["amount"])
    balance = _account(world, source)
    _account(world, target)
    if amount <= 0:
        raise ToolError("invalid_amount", "the amount must be positive")
    if source == target:
        raise ToolError("same_account", "source and target are the same account")
    if amount > balance:
        raise ToolError("insufficient_funds", f"{source} holds {balance:.2f} USD, less than {amount:.2f}")
    accounts = world["bank"]["accounts"]
    accounts[source] = _money(accounts[source] - amount)
    accounts[target] = _money(accounts[target] + amount)
    world["bank"]["transfers"].append({"source": source, "target": target, "amount": amount})
    return {"status": "completed", "amount": amount, "source_balance": accounts[source], "currency": "USD"}


def deposit(world: dict[str, Any], args: dict[str, Any]) -> Any:
    name, amount = args["account"], _money(args["amount"])
    _account(world, name)
    if amount <= 0:
        raise ToolError("invalid_amount", "the amount must be positive")
    accounts = world["bank"]["accounts"]
    accounts[name] = _money(accounts[name] + amount)
    return {"account": name, "balance": accounts[name], "currency": "USD"}


# ---------------------------------------------------------------------------------------------- files


def _path(args: dict[str, Any]) -> str:
    path = str(args["path"]).strip()
    if not path or ".." in path or path.startswith("/"):
        raise ToolError("invalid_path", f"invalid path {path!r}")
    return path


def write_file(world: dict[str, Any], args: dict[str, Any]) -> Any:
    path = _path(args)
    world["files"]["files"][path] = str(args["text"])
    return {"path": path, "bytes": len(str(args["text"]).encode())}


def read_file(world: dict[str, Any], args: dict[str, Any]) -> Any:
    path = _path(args)
    if path not in world["files"]["files"]:
        raise ToolError("file_not_found", f"no such file {path!r}")
    return {"path": path, "text": world["files"]["files"][path]}


def append_file(world: dict[str, Any], args: dict[str, Any]) -> Any:
    path = _path(args)
    files = world["files"]["files"]
    if path not in files:
        raise ToolError("file_not_found", f"no such file {path!r}")
    files[path] += str(args["text"])
    return {"path": path, "bytes": len(files[path].encode())}


def list_files(world: dict[str, Any], args: dict[str, Any]) -> Any:
    return {"files": sorted(world["files"]["files"])}


def delete_file(world: dict[str, Any], args: dict[str, Any]) -> Any:
    path = _path(args)
    if world["files"]["files"].pop(path, None) is None:
        raise ToolError("file_not_found", f"no such file {path!r}")
    return {"deleted": path}


# ----------------------------------------------------------------------------------------------- math

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.FloorDiv: operator.floordiv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def safe_calculate(expression: str) -> float:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses) without ``eval``."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ToolError("invalid_expression", f"cannot parse {expression!r}") from error
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ToolError("invalid_expression", "exponent too large")
        try:
            return _OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError as error:
            raise ToolError("division_by_zero", "division by zero") from error
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ToolError("invalid_expression", f"unsupported syntax {type(node).__name__}")


def format_number(value: float) -> str:
    """A number as an answer writes it: integers without decimals, others with up to 4."""
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4f}".rstrip("0").rstrip(".")
    return str(int(value))


def calculate(world: dict[str, Any], args: dict[str, Any]) -> Any:
    value = safe_calculate(str(args["expression"]))
    world["math"]["history"].append(str(args["expression"]))
    return {"expression": args["expression"], "result": value}


def convert_units(world: dict[str, Any], args: dict[str, Any]) -> Any:
    source, target = args["from_unit"], args["to_unit"]
    if source not in LENGTH_UNITS or target not in LENGTH_UNITS:
        raise ToolError("unknown_unit", f"cannot convert {source!r} to {target!r}")
    value = float(args["value"]) * LENGTH_UNITS[source] / LENGTH_UNITS[target]
    return {"value": round(value, 4), "unit": target}


def statistics(world: dict[str, Any], args: dict[str, Any]) -> Any:
    numbers = [float(x) for x in args["numbers"]]
    if not numbers:
        raise ToolError("empty_input", "no numbers given")
    ordered = sorted(numbers)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    ops = {"mean": sum(numbers) / len(numbers), "median": median, "max": max(numbers), "min": min(numbers)}
    ops["sum"] = sum(numbers)
    return {"op": args["op"], "result": ops[args["op"]]}


# ------------------------------------------------------------------------------------------ inventory


def _stock(world: dict[str, Any], sku: str) -> int:
    stock = world["inventory"]["stock"]
    if sku not in stock:
        raise ToolError("unknown_sku", f"unknown SKU {sku!r}")
    return stock[sku]


def check_stock(world: dict[str, Any], args: dict[str, Any]) -> Any:
    return {"sku": args["sku"], "on_hand": _stock(world, args["sku"])}


def list_skus(world: dict[str, Any], args: dict[str, Any]) -> Any:
    return {"skus": [{"sku": k, "on_hand": v} for k, v in world["inventory"]["stock"].items()]}


def restock(world: dict[str, Any], args: dict[str, Any]) -> Any:
    sku, qty = args["sku"], int(args["qty"])
    _stock(world, sku)
    if qty < 1:
        raise ToolError("invalid_quantity", "quantity must be at least 1")
    world["inventory"]["stock"][sku] += qty
    return {"sku": sku, "on_hand": world["inventory"]["stock"][sku]}


def ship_order(world: dict[str, Any], args: dict[str, Any]) -> Any:
    sku, qty, address = args["sku"], int(args["qty"]), str(args["address"])
    on_hand = _stock(world, sku)
    if qty < 1:
        raise ToolError("invalid_quantity", "quantity must be at least 1")
    if qty > on_hand:
        raise ToolError("insufficient_stock", f"only {on_hand} units of {sku} on hand")
    world["inventory"]["stock"][sku] -= qty
    shipment = {"shipment_id": f"S-{501 + len(world['inventory']['shipments'])}", "sku": sku, "qty": qty}
    shipment["address"] = address
    world["inventory"]["shipments"].append(shipment)
    return dict(shipment)


# --------------------------------------------------------------------------------------------- travel


def search_flights(world: dict[str, Any], args: dict[str, Any]) -> Any:
    wanted = (args["origin"], args["destination"], args.get("day"))
    found = [
        dict(f)
        for f in world["travel"]["flights"]
        if (f["origin"], f["destination"]) == wanted[:2] and wanted[2] in (None, f["day"])
    ]
    return {"flights": found, "currency": "USD"}


def book_flight(world: dict[str, Any], args: dict[str, Any]) -> Any:
    flights = {f["id"]: f for f in world["travel"]["flights"]}
    flight = flights.get(args["flight_id"])
    if flight is None:
        raise ToolError("unknown_flight", f"unknown flight {args['flight_id']!r}")
    if flight["seats"] < 1:
        raise ToolError("sold_out", f"flight {flight['id']} is sold out")
    flight["seats"] -= 1
    bookings = world["travel"]["bookings"]
    booking = {"booking_id": f"B-{301 + len(bookings)}", "flight_id": flight["id"]}
    booking["passenger"] = str(args["passenger"])
    bookings.append(booking)
    return {**booking, "status": "confirmed"}


def cancel_booking(world: dict[str, Any], args: dict[str, Any]) -> Any:
    bookings = world["travel"]["bookings"]
    for booking in bookings:
        if booking["booking_id"] == args["booking_id"]:
            bookings.remove(booking)
            for flight in world["travel"]["flights"]:
                if flight["id"] == booking["flight_id"]:
                    flight["seats"] += 1
            return {"cancelled": booking["booking_id"]}
    raise ToolError("unknown_booking", f"unknown booking {args['booking_id']!r}")


# ------------------------------------------------------------------------------------------ hierarchy


def _string(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


def _integer(description: str, minimum: int | None = None, maximum: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "description": description}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


ITEM = Param("item", _string("Product name, e.g. 'apple'."))
QTY = Param("qty", _integer("How many units.", 1))
TITLE = Param("title", _string("The event's title."))
DAY = Param("day", {"type": "string", "enum": list(DAYS), "description": "Day of the week."}, kind="day")
HOUR = Param("hour", _integer("Start hour, 0-23.", 0, 23), kind="hour")
MONEY = Param(
    "amount", {"type": "number", "description": "Amount in US dollars.", "minimum": 0}, kind="money"
)
ACCOUNT = Param("account", _string("Account name, e.g. 'checking'."))
PATH = Param("path", _string("Relative file path, e.g. 'notes.txt'."))
TEXT = Param("text", _string("Text to write."))
SKU = Param("sku", _string("Stock keeping unit, e.g. 'SKU-100'."))
UNIT = {"type": "string", "enum": list(LENGTH_UNITS), "description": "Length unit."}

BASE_TOOLS: tuple[BaseTool, ...] = (
    BaseTool("search_products", "retail", "catalog", "Search the store's catalog by name.",
             (Param("query", _string("Words to look for.")),), search_products, True, "products",
             ("find_products", "product_search", "lookup_items")),
    BaseTool("add_to_cart", "retail", "cart", "Add units of a product to the shopping cart.",
             (ITEM, QTY), add_to_cart, aliases=("cart_add", "add_item", "put_in_basket")),
    BaseTool("remove_from_cart", "retail", "cart", "Remove units of a product from the cart (all if no qty).",
             (ITEM, Param("qty", _integer("Units to remove.", 1), required=False)), remove_from_cart,
             aliases=("cart_remove", "drop_item", "take_out_of_basket")),
    BaseTool("view_cart", "retail", "cart", "Show the cart's items and total.", (), view_cart, True, "items",
             ("show_cart", "get_basket", "cart_contents")),
    BaseTool("checkout", "retail", "orders", "Place an order for everything in the cart.", (), checkout,
             aliases=("place_order", "submit_order", "buy_cart")),
    BaseTool("create_event", "calendar", "events", "Create a calendar event.", (TITLE, DAY, HOUR),
             create_event, aliases=("add_event", "schedule_event", "new_meeting")),
    BaseTool("list_events", "calendar", "events", "List calendar events, optionally of one day.",
             (Param(DAY.name, DAY.schema, False, "day"),), list_events, True, "events",
             ("get_events", "show_calendar", "agenda")),
    BaseTool("delete_event", "calendar", "events", "Delete an event by title.", (TITLE,), delete_event,
             aliases=("remove_event", "cancel_event", "drop_meeting")),
    BaseTool("move_event", "calendar", "events", "Move an event to another day and hour.", (TITLE, DAY, HOUR),
             move_event, aliases=("reschedule_event", "update_event_time", "shift_meeting")),
    BaseTool("list_accounts", "bank", "accounts", "List the user's bank accounts.", (), list_accounts, True,
             "accounts", ("get_accounts", "show_accounts", "accounts_overview")),
    BaseTool("get_balance", "bank", "accounts", "Get an account's balance.", (ACCOUNT,), get_balance, True,
             aliases=("check_balance", "account_balance", "balance_inquiry")),
    BaseTool("transfer", "bank", "payments", "Transfer money between two accounts.",
             (Param("source", _string("Account to debit.")), Param("target", _string("Account to credit.")),
              MONEY), transfer, aliases=("transfer_funds", "move_money", "send_money")),
    BaseTool("deposit", "bank", "payments", "Deposit money into an account.", (ACCOUNT, MONEY), deposit,
             aliases=("add_funds", "credit_account", "make_deposit")),
    BaseTool("write_file", "files", "io", "Create or overwrite a text file.", (PATH, TEXT), write_file,
             aliases=("save_file", "create_file", "put_file")),
    BaseTool("read_file", "files", "io", "Read a text file.", (PATH,), read_file, True,
             aliases=("open_file", "get_file", "cat_file")),
    BaseTool("append_file", "files", "io", "Append text to an existing file.", (PATH, TEXT), append_file,
             aliases=("append_text", "add_to_file", "file_append")),
    BaseTool("list_files", "files", "directory", "List the files.", (), list_files, True, "files",
             ("ls", "dir_listing", "show_files")),
    BaseTool("delete_file", "files", "directory", "Delete a file.", (PATH,), delete_file,
             aliases=("remove_file", "rm_file", "erase_file")),
    BaseTool("calculate", "math", "arithmetic", "Evaluate an arithmetic expression.",
             (Param("expression", _string("Arithmetic, e.g. '(2 + 3) * 4'.")),), calculate, True,
             aliases=("calc", "evaluate_expression", "compute")),
    BaseTool("convert_units", "math", "units", "Convert a length between units.",
             (Param("value", {"type": "number", "description": "The length."}),
              Param("from_unit", dict(UNIT), kind="unit"), Param("to_unit", dict(UNIT), kind="unit")),
             convert_units, True, aliases=("unit_convert", "length_conversion", "convert_length")),
    BaseTool("statistics", "math", "statistics", "Summary statistic of a list of numbers.",
             (Param("numbers", {"type": "array", "items": {"type": "number"}, "description": "The data."}),
              Param("op", {"type": "string", "enum": ["mean", "median", "max", "min", "sum"]})),
             statistics, True, aliases=("describe_numbers", "stats", "aggregate")),
    BaseTool("check_stock", "inventory", "stock", "Units of a SKU on hand.", (SKU,), check_stock, True,
             aliases=("stock_level", "get_inventory", "units_on_hand")),
    BaseTool("list_skus", "inventory", "stock", "List all SKUs with stock.", (), list_skus, True, "skus",
             ("inventory_report", "all_stock", "sku_catalog")),
    BaseTool("restock", "inventory", "stock", "Add units of a SKU to the warehouse.", (SKU, QTY), restock,
             aliases=("replenish", "receive_stock", "add_stock")),
    BaseTool("ship_order", "inventory", "shipping", "Ship units of a SKU to an address.",
             (SKU, QTY, Param("address", _string("Delivery address."))), ship_order,
             aliases=("create_shipment", "dispatch", "send_shipment")),
    BaseTool("search_flights", "travel", "flights", "Find flights between two cities (optionally on a day).",
             (Param("origin", _string("Departure city.")), Param("destination", _string("Arrival city.")),
              Param(DAY.name, DAY.schema, False, "day")), search_flights, True, "flights",
             ("find_flights", "flight_search", "lookup_flights")),
    BaseTool("book_flight", "travel", "bookings", "Book a seat on a flight.",
             (Param("flight_id", _string("Flight id from a search, e.g. 'FL107'.")),
              Param("passenger", _string("Passenger's full name."))), book_flight,
             aliases=("reserve_flight", "buy_ticket", "flight_booking")),
    BaseTool("cancel_booking", "travel", "bookings", "Cancel a booking.",
             (Param("booking_id", _string("Booking id, e.g. 'B-301'.")),), cancel_booking,
             aliases=("cancel_reservation", "void_booking", "refund_booking")),
)  # fmt: skip

DOMAINS: dict[str, str] = {
    "retail": "an online grocery store",
    "calendar": "a personal calendar",
    "bank": "personal bank accounts",
    "files": "a workspace of text files",
    "math": "a calculator and unit converter",
    "inventory": "a warehouse inventory",
    "travel": "a travel agency",
}
PREFIXES = {
    "retail": ("shop_", "store_", "grocer_", "mart_"),
    "calendar": ("cal_", "agenda_", "planner_", "sched_"),
    "bank": ("bank_", "fin_", "ledger_", "acct_"),
    "files": ("fs_", "doc_", "drive_", "vault_"),
    "math": ("math_", "calc_", "num_", "sci_"),
    "inventory": ("wh_", "stock_", "depot_", "inv_"),
    "travel": ("trip_", "air_", "travel_", "jet_"),
}
SYNONYMS = {
    "item": ("product", "item_name", "product_name", "article"),
    "qty": ("quantity", "count", "units", "n_items"),
    "query": ("search", "keywords", "term", "q"),
    "title": ("name", "event_title", "summary", "subject"),
    "day": ("weekday", "on_day", "day_of_week"),
    "hour": ("start_hour", "at_hour", "hour_of_day"),
    "account": ("account_name", "acct", "account_id"),
    "source": ("from_account", "sender", "debit_account", "payer"),
    "target": ("to_account", "recipient", "credit_account", "payee"),
    "amount": ("value", "sum", "amount_usd"),
    "path": ("filename", "file_path", "file_name"),
    "text": ("content", "body", "data"),
    "expression": ("expr", "formula", "math_input"),
    "value": ("length", "number", "magnitude"),
    "from_unit": ("source_unit", "unit_in", "input_unit"),
    "to_unit": ("target_unit", "unit_out", "output_unit"),
    "numbers": ("values", "data", "samples"),
    "op": ("statistic", "operation", "measure"),
    "sku": ("product_code", "item_code", "sku_id"),
    "address": ("ship_to", "destination_address", "deliver_to"),
    "origin": ("from_city", "departure", "origin_city"),
    "destination": ("to_city", "arrival", "destination_city"),
    "flight_id": ("flight", "flight_number", "flight_code"),
    "passenger": ("traveler", "passenger_name", "full_name"),
    "booking_id": ("booking", "reservation_id", "confirmation_code"),
}
EXTRAS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("note", _string("Optional free-text note (stored in the audit log only).")),
    ("request_id", _string("Optional idempotency key.")),
    ("locale", {"type": "string", "enum": ["en-US", "en-GB", "de-DE"], "description": "Response locale."}),
    ("verbose", {"type": "boolean", "description": "Return extra detail (ignored by this backend)."}),
    ("trace", {"type": "boolean", "description": "Enable request tracing."}),
)


def unit_codecs(kind: str) -> list[tuple[Codec, tuple[str, ...]]]:
    """The codecs evolution may pick for a parameter kind, each with parameter names that fit it (empty:
    keep the canonical names and synonyms)."""
    if kind == "money":
        cents = Codec(
            "scale",
            100.0,
            schema=(("type", "integer"), ("description", "Amount in US cents."), ("minimum", 0)),
            note="amounts in cents",
        )
        return [(IDENTITY, ()), (cents, ("amount_cents", "cents", "value_cents"))]
    if kind == "day":
        full = Codec(
            "enum",
            mapping=tuple(zip(DAYS, FULL_DAYS, strict=True)),
            schema=(("enum", list(FULL_DAYS)),),
            note="days spelled out",
        )
        index = Codec(
            "enum",
            mapping=tuple((d, i) for i, d in enumerate(DAYS)),
            schema=(
                ("type", "integer"),
                ("enum", list(range(7))),
                ("description", "Day index, 0 = Monday ... 6 = Sunday."),
            ),
            note="days as 0-6 from Monday",
        )
        return [(IDENTITY, ()), (full, ()), (index, ("day_index", "weekday_number"))]
    if kind == "hour":
        minutes = Codec(
            "scale",
            60.0,
            schema=(
                ("type", "integer"),
                ("minimum", 0),
                ("maximum", 1380),
                ("description", "Start as minutes after midnight."),
            ),
            note="times in minutes after midnight",
        )
        clock = Codec(
            "enum",
            mapping=tuple((h, f"{h:02d}:00") for h in range(24)),
            schema=(
                ("type", "string"),
                ("enum", [f"{h:02d}:00" for h in range(24)]),
                ("description", "Start time, HH:00."),
            ),
            note="times as HH:00",
        )
        return [(IDENTITY, ()), (minutes, ("start_minute", "minute_of_day")), (clock, ("start_time", "at"))]
    if kind == "unit":
        spelled = Codec(
            "enum",
            mapping=tuple(LONG_UNIT_NAMES.items()),
            schema=(("enum", list(LONG_UNIT_NAMES.values())),),
            note="unit names spelled out",
        )
        return [(IDENTITY, ()), (spelled, ())]
    return [(IDENTITY, ())]


# ---------------------------------------------------------------------------------------- synthetic tool


@dataclass
class SyntheticTool:
    """One evolved tool: a spec (OpenAI format) over a base tool's semantics."""

    name: str
    base: BaseTool
    description: str
    arg_names: dict[str, str]  # canonical -> exposed
    codecs: dict[str, Codec] = field(default_factory=dict)
    extras: dict[str, dict[str, Any]] = field(default_factory=dict)
    variant: int = 0

    @property
    def domain(self) -> str:
        return self.base.domain

    @property
    def family(self) -> str:
        return self.base.family

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the exposed arguments."""
        properties: dict[str, Any] = {}
        required = []
        for param in self.base.params:
            codec = self.codecs.get(param.name, IDENTITY)
            schema = {**param.schema, **dict(codec.schema)}
            if codec.kind == "enum" and "enum" in schema and schema.get("type") == "integer":
                schema.pop("minimum", None)
            exposed = self.arg_names[param.name]
            properties[exposed] = schema
            if param.required:
                required.append(exposed)
        properties.update(self.extras)
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }

    @property
    def spec(self) -> dict[str, Any]:
        """The OpenAI ``{"type": "function", "function": {...}}`` spec."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def encode(self, canonical: dict[str, Any]) -> dict[str, Any]:
        """This tool's arguments for canonical ones (unknown canonical names are dropped)."""
        return {
            self.arg_names[key]: self.codecs.get(key, IDENTITY).encode(value)
            for key, value in canonical.items()
            if key in self.arg_names
        }

    def decode(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The canonical arguments of this tool's arguments (extras dropped)."""
        exposed = {v: k for k, v in self.arg_names.items()}
        return {
            exposed[key]: self.codecs.get(exposed[key], IDENTITY).decode(value)
            for key, value in arguments.items()
            if key in exposed
        }

    def execute(self, state: dict[str, Any], arguments: dict[str, Any]) -> Any:
        """Run the call on the world ``state`` (mutated in place); raises ``ToolError`` for domain errors."""
        return self.base.impl(state, self.decode(arguments))


def canonical_tool(base: BaseTool) -> SyntheticTool:
    """The base tool as a synthetic tool with its canonical names and units."""
    names = {param.name: param.name for param in base.params}
    return SyntheticTool(base.key, base, base.description, names)


def _variant(base: BaseTool, rng: random.Random, taken: set[str], variant: int) -> SyntheticTool:
    """One evolved variant of ``base`` with a name not in ``taken``."""
    name = _variant_name(base, rng, taken)
    codecs, names, notes = {}, {}, []
    for param in base.params:
        codec, codec_names = rng.choice(unit_codecs(param.kind))
        if codec is not IDENTITY:
            codecs[param.name] = codec
            notes.append(codec.note)
        options = codec_names or (param.name, *SYNONYMS.get(param.name, ()))
        names[param.name] = _fresh(rng.choice(options), names.values())
    extras = dict(rng.sample(EXTRAS, rng.choice((0, 0, 1, 2))))
    for key in list(extras):
        if key in names.values():
            del extras[key]
    description = base.description + (f" Note: {', '.join(notes)}." if notes else "")
    if rng.random() < 0.3:
        description = f"[{name.split('_')[0]}] {description}"
    return SyntheticTool(name, base, description, names, codecs, extras, variant)


def _fresh(name: str, used: Iterable[str]) -> str:
    used = set(used)
    candidate, index = name, 2
    while candidate in used:
        candidate, index = f"{name}{index}", index + 1
    return candidate


def _variant_name(base: BaseTool, rng: random.Random, taken: set[str]) -> str:
    stems = (base.key, *base.aliases)
    for _ in range(20):
        name = rng.choice(PREFIXES[base.domain]) * (rng.random() < 0.7) + rng.choice(stems)
        name += rng.choice(("", "", "_v2", "_v3", "_api"))
        if name not in taken:
            return name
    return _fresh(f"{rng.choice(PREFIXES[base.domain])}{base.key}_x", taken)


def evolve(seed: int, n: int, taken: Iterable[str] = ()) -> list[SyntheticTool]:
    """``n`` evolved variants, round-robin over the base tools, deterministic in ``seed``; names are unique
    and avoid ``taken``."""
    rng = random.Random(f"evolve:{seed}")
    used = set(taken)
    tools = []
    for index in range(n):
        base = BASE_TOOLS[index % len(BASE_TOOLS)]
        tool = _variant(base, rng, used, index // len(BASE_TOOLS) + 1)
        used.add(tool.name)
        tools.append(tool)
    return tools


# ------------------------------------------------------------------------------------------- repository


def load_mcp_tools(path: str | Path) -> list[dict[str, Any]]:
    """The harvested tools of a ``k2lab tools harvest`` JSONL (the whole records; ``openai`` is the spec).
    Invalid lines or specs raise ``K2LabError`` naming the line."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            spec = record.get("openai") or {
                "type": "function",
                "function": {k: record[k] for k in ("name", "description", "parameters") if k in record},
            }
            record["openai"] = validate_tool(spec)
        except (ValueError, AttributeError, K2LabError) as error:
            raise K2LabError(f"{path}:{number}: not a harvested tool spec ({error})") from error
        records.append(record)
    return records


@dataclass
class ToolRepository:
    """Synthetic tools by name (with semantics) and spec-only MCP tools by name."""

    synthetic: dict[str, SyntheticTool] = field(default_factory=dict)
    mcp: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add_synthetic(self, tools: Iterable[SyntheticTool]) -> None:
        for tool in tools:
            if tool.name in self.synthetic or tool.name in self.mcp:
                raise K2LabError(f"duplicate tool name {tool.name!r}")
            self.synthetic[tool.name] = tool

    def add_mcp(self, records: Iterable[dict[str, Any]]) -> None:
        """Add harvested tools; a name clashing with a synthetic tool gets an ``mcp_`` prefix."""
        for record in records:
            spec = json.loads(json.dumps(record["openai"]))
            name = spec["function"]["name"]
            if name in self.synthetic or name in self.mcp:
                name = _fresh(f"mcp_{name}"[:60], set(self.synthetic) | set(self.mcp))
                spec["function"]["name"] = name
            self.mcp[name] = {**record, "name": name, "openai": spec}

    def evolve(self, seed: int, n: int) -> list[SyntheticTool]:
        """Evolve ``n`` more variants (deterministic in ``seed`` and the current names) and add them."""
        tools = evolve(seed, n, taken=set(self.synthetic) | set(self.mcp))
        self.add_synthetic(tools)
        return tools

    def spec(self, name: str) -> dict[str, Any]:
        return self.synthetic[name].spec if name in self.synthetic else self.mcp[name]["openai"]

    def specs(self) -> list[dict[str, Any]]:
        return [tool.spec for tool in self.synthetic.values()] + [r["openai"] for r in self.mcp.values()]

    def by_domain(self) -> dict[str, dict[str, list[SyntheticTool]]]:
        """domain -> base tool key -> its synthetic tools (the hierarchy, families implied by the bases)."""
        tree: dict[str, dict[str, list[SyntheticTool]]] = {}
        for tool in self.synthetic.values():
            tree.setdefault(tool.domain, {}).setdefault(tool.base.key, []).append(tool)
        return tree

    def hierarchy(self) -> dict[str, dict[str, int]]:
        """domain -> family -> number of tools."""
        counts: dict[str, dict[str, int]] = {}
        for tool in self.synthetic.values():
            family = counts.setdefault(tool.domain, {})
            family[tool.family] = family.get(tool.family, 0) + 1
        return counts

    def __len__(self) -> int:
        return len(self.synthetic) + len(self.mcp)


def build_repository(
    seed: int = 0, variants_per_tool: int = 12, mcp_path: str | Path | None = None
) -> ToolRepository:
    """The canonical tools, ``variants_per_tool`` evolved variants of each, and harvested MCP tools."""
    repository = ToolRepository()
    repository.add_synthetic(canonical_tool(base) for base in BASE_TOOLS)
    repository.evolve(seed, variants_per_tool * len(BASE_TOOLS))
    if mcp_path is not None:
        repository.add_mcp(load_mcp_tools(mcp_path))
    return repository
