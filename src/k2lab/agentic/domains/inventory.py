"""The inventory domain: a warehouse's stock by SKU and its outgoing shipments.

World section ``inventory``: ``stock`` (SKU -> units on hand) and ``shipments``. Tasks: restock a SKU (the
full stock report maybe asked for afterwards), ship units to an address (the address maybe held back), look
up a SKU's stock. Checks: ``stock``, ``shipment``.
"""

from __future__ import annotations

import random
from typing import Any

from k2lab.agentic.domains.base import (
    QTY,
    BaseTool,
    Clarification,
    Domain,
    Draft,
    Param,
    Phase,
    Step,
    ToolError,
    clarify,
    string,
)

__all__ = ["ADDRESSES", "DOMAIN", "SKUS"]

SKUS = ("SKU-100", "SKU-200", "SKU-300", "SKU-400", "SKU-500")
#: Delivery addresses of shipping tasks.
ADDRESSES = ("12 Elm St, Springfield", "4 Harbour Rd, Oslo", "77 Via Roma, Rome", "9 Rue Cler, Paris")


def initial_state(rng: random.Random) -> dict[str, Any]:
    """0-40 units of each of the ``SKUS``, no shipments."""
    return {"stock": {sku: rng.randint(0, 40) for sku in SKUS}, "shipments": []}


# ------------------------------------------------------------------------------------------------ tools


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


SKU = Param(
    "sku", string("Stock keeping unit, e.g. 'SKU-100'."), synonyms=("product_code", "item_code", "sku_id")
)
ADDRESS = Param(
    "address", string("Delivery address."), synonyms=("ship_to", "destination_address", "deliver_to")
)

TOOLS: tuple[BaseTool, ...] = (
    BaseTool("check_stock", "inventory", "stock", "Units of a SKU on hand.", (SKU,), check_stock, True,
             aliases=("stock_level", "get_inventory", "units_on_hand")),
    BaseTool("list_skus", "inventory", "stock", "List all SKUs with stock.", (), list_skus, True, "skus",
             ("inventory_report", "all_stock", "sku_catalog")),
    BaseTool("restock", "inventory", "stock", "Add units of a SKU to the warehouse.", (SKU, QTY), restock,
             aliases=("replenish", "receive_stock", "add_stock")),
    BaseTool("ship_order", "inventory", "shipping", "Ship units of a SKU to an address.", (SKU, QTY, ADDRESS),
             ship_order, aliases=("create_shipment", "dispatch", "send_shipment")),
)  # fmt: skip


# ------------------------------------------------------------------------------------------------ tasks


def inventory_restock(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Add received units to a SKU's stock (the full stock report maybe asked for after)."""
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
    """Ship units of a SKU to an address (the address maybe held back)."""
    stock = world["inventory"]["stock"]
    sku = rng.choice(sorted(stock))
    stock[sku] = max(stock[sku], 5)
    qty, address = rng.randint(1, stock[sku]), rng.choice(ADDRESSES)
    steps = [Step("ship_order", {"sku": sku, "qty": qty, "address": address})]
    answer = f"Shipment S-501 of {qty} x {sku} is on its way to {address}."
    if clarify(rng):
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
    """Look up a SKU's units on hand."""
    sku = rng.choice(sorted(world["inventory"]["stock"]))
    value = world["inventory"]["stock"][sku]
    steps = [Step("check_stock", {"sku": sku})]
    phase = Phase(f"How many units of {sku} do we have?", steps, f"We have {value} units of {sku} on hand.")
    return Draft(
        "inventory_check",
        [phase],
        [{"kind": "unchanged", "section": "inventory", "description": "no change"}],
    )


# ----------------------------------------------------------------------------------------------- checks


def _stock_is(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    value = world["inventory"]["stock"].get(check["sku"])
    return None if value == check["qty"] else f"{check['sku']} has {value} units, expected {check['qty']}"


def _shipment(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    new = world["inventory"]["shipments"][len(initial["inventory"]["shipments"]) :]
    wanted = (check["sku"], check["qty"], check["address"])
    if [(s["sku"], s["qty"], s["address"]) for s in new] != [wanted]:
        return (
            f"expected one new shipment {wanted}, found {[(s['sku'], s['qty'], s['address']) for s in new]}"
        )
    return None


DOMAIN = Domain(
    name="inventory",
    description="a warehouse inventory",
    prefixes=("wh_", "stock_", "depot_", "inv_"),
    tools=TOOLS,
    templates=(inventory_restock, inventory_ship, inventory_check),
    initial_state=initial_state,
    checks={"stock": _stock_is, "shipment": _shipment},
)
