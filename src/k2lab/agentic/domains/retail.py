"""The retail domain: an online grocery store's catalog, cart and orders.

World section ``retail``: ``catalog`` (item -> price in dollars and units in stock), ``cart`` (item ->
units) and ``orders``. Tasks: order one product (the quantity maybe held back, the total maybe asked for
afterwards), a two-product basket, dropping an item before checkout. Checks: ``order_placed``,
``cart_empty``.
"""

from __future__ import annotations

import random
from dataclasses import replace
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
    integer,
    money,
    string,
)

__all__ = ["DOMAIN", "ITEMS"]

#: The products a store may sell (five are drawn per world) and their prices in dollars.
ITEMS = {"apple": 0.5, "banana": 0.25, "coffee": 7.5, "bread": 3.0, "milk": 1.2, "cheese": 5.75, "eggs": 2.4}


def initial_state(rng: random.Random) -> dict[str, Any]:
    """Five products of ``ITEMS`` with 5-20 units each, an empty cart, no orders."""
    items = rng.sample(sorted(ITEMS), 5)
    catalog = {item: {"price": ITEMS[item], "stock": rng.randint(5, 20)} for item in items}
    return {"catalog": catalog, "cart": {}, "orders": []}


# ------------------------------------------------------------------------------------------------ tools


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
    return money(sum(catalog[item]["price"] * qty for item, qty in world["retail"]["cart"].items()))


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


QUERY = Param("query", string("Words to look for."), synonyms=("search", "keywords", "term", "q"))
ITEM = Param(
    "item",
    string("Product name, e.g. 'apple'."),
    synonyms=("product", "item_name", "product_name", "article"),
)
QTY_REMOVED = replace(QTY, schema=integer("Units to remove.", 1), required=False)

TOOLS: tuple[BaseTool, ...] = (
    BaseTool("search_products", "retail", "catalog", "Search the store's catalog by name.", (QUERY,),
             search_products, True, "products", ("find_products", "product_search", "lookup_items")),
    BaseTool("add_to_cart", "retail", "cart", "Add units of a product to the shopping cart.",
             (ITEM, QTY), add_to_cart, aliases=("cart_add", "add_item", "put_in_basket")),
    BaseTool("remove_from_cart", "retail", "cart", "Remove units of a product from the cart (all if no qty).",
             (ITEM, QTY_REMOVED), remove_from_cart,
             aliases=("cart_remove", "drop_item", "take_out_of_basket")),
    BaseTool("view_cart", "retail", "cart", "Show the cart's items and total.", (), view_cart, True, "items",
             ("show_cart", "get_basket", "cart_contents")),
    BaseTool("checkout", "retail", "orders", "Place an order for everything in the cart.", (), checkout,
             aliases=("place_order", "submit_order", "buy_cart")),
)  # fmt: skip


# ------------------------------------------------------------------------------------------------ tasks


def retail_order(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Order units of one product (the quantity maybe held back; the total maybe asked for after)."""
    catalog = world["retail"]["catalog"]
    item = rng.choice(sorted(catalog))
    qty = rng.randint(1, min(4, catalog[item]["stock"]))
    total = round(catalog[item]["price"] * qty, 2)
    answer = f"Your order O-1001 is placed: {qty} x {item}, total {total:.2f} USD."
    steps = [Step("add_to_cart", {"item": item, "qty": qty}), Step("checkout")]
    if clarify(rng):
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
    """Take one of two products out of a prepared cart, then check out."""
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


# ----------------------------------------------------------------------------------------------- checks


def _order_placed(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    new = world["retail"]["orders"][len(initial["retail"]["orders"]) :]
    if len(new) != 1:
        return f"expected one new order, found {len(new)}"
    if new[0]["items"] != check["items"]:
        return f"the order holds {new[0]['items']}, expected {check['items']}"
    return None


def _cart_empty(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    cart = world["retail"]["cart"]
    return f"the cart still holds {cart}" if cart else None


DOMAIN = Domain(
    name="retail",
    description="an online grocery store",
    prefixes=("shop_", "store_", "grocer_", "mart_"),
    tools=TOOLS,
    templates=(retail_order, retail_order, retail_basket, retail_remove),
    initial_state=initial_state,
    checks={"order_placed": _order_placed, "cart_empty": _cart_empty},
)
