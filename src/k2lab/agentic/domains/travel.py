"""The travel domain: flights between European cities, bookings and cancellations.

World section ``travel``: ``flights`` (id, origin, destination, day, price in dollars, free seats; no two
with the same id or the same route and day) and ``bookings``. Tasks: search and book a flight (the
passenger maybe held back), cancel a booking. Checks: ``booking``, ``booking_absent``.
"""

from __future__ import annotations

import random
from typing import Any

from k2lab.agentic.domains.base import (
    DAYS,
    OPTIONAL_DAY,
    BaseTool,
    Clarification,
    Domain,
    Draft,
    Param,
    Phase,
    Step,
    ToolError,
    clarify,
    day_name,
    string,
)

__all__ = ["CITIES", "DOMAIN", "PASSENGERS"]

CITIES = ("Berlin", "Paris", "Rome", "Madrid", "Vienna", "Oslo")
#: Passengers of booking tasks.
PASSENGERS = ("Ada Lovelace", "Alan Turing", "Grace Hopper", "Katherine Johnson", "Edsger Dijkstra")


def initial_state(rng: random.Random) -> dict[str, Any]:
    """Up to eight flights between ``CITIES`` (repeats of an id or a route and day dropped), no bookings."""
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
    return {"flights": _unique_flights(flights), "bookings": []}


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


# ------------------------------------------------------------------------------------------------ tools


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


ORIGIN = Param("origin", string("Departure city."), synonyms=("from_city", "departure", "origin_city"))
DESTINATION = Param(
    "destination", string("Arrival city."), synonyms=("to_city", "arrival", "destination_city")
)
FLIGHT_ID = Param(
    "flight_id",
    string("Flight id from a search, e.g. 'FL107'."),
    synonyms=("flight", "flight_number", "flight_code"),
)
PASSENGER = Param(
    "passenger", string("Passenger's full name."), synonyms=("traveler", "passenger_name", "full_name")
)
BOOKING_ID = Param(
    "booking_id",
    string("Booking id, e.g. 'B-301'."),
    synonyms=("booking", "reservation_id", "confirmation_code"),
)

TOOLS: tuple[BaseTool, ...] = (
    BaseTool("search_flights", "travel", "flights", "Find flights between two cities (optionally on a day).",
             (ORIGIN, DESTINATION, OPTIONAL_DAY), search_flights, True, "flights",
             ("find_flights", "flight_search", "lookup_flights")),
    BaseTool("book_flight", "travel", "bookings", "Book a seat on a flight.", (FLIGHT_ID, PASSENGER),
             book_flight, aliases=("reserve_flight", "buy_ticket", "flight_booking")),
    BaseTool("cancel_booking", "travel", "bookings", "Cancel a booking.", (BOOKING_ID,), cancel_booking,
             aliases=("cancel_reservation", "void_booking", "refund_booking")),
)  # fmt: skip


# ------------------------------------------------------------------------------------------------ tasks


def travel_book(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Search a route and book a passenger on its flight (the passenger maybe held back)."""
    flight = rng.choice(world["travel"]["flights"])
    flight["seats"] = max(flight["seats"], 1)
    passenger = rng.choice(PASSENGERS)
    route = f"from {flight['origin']} to {flight['destination']} on {day_name(flight['day'])}"
    steps = [
        Step(
            "search_flights",
            {"origin": flight["origin"], "destination": flight["destination"], "day": flight["day"]},
        ),
        Step("book_flight", {"flight_id": flight["id"], "passenger": passenger}),
    ]
    answer = f"{passenger} is booked on {flight['id']} {route}; booking B-301."
    if clarify(rng):
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
    """Cancel a booking made beforehand."""
    flight = rng.choice(world["travel"]["flights"])
    world["travel"]["bookings"].append({"booking_id": "B-300", "flight_id": flight["id"], "passenger": "you"})
    steps = [Step("cancel_booking", {"booking_id": "B-300"})]
    phase = Phase("Please cancel my booking B-300.", steps, "Booking B-300 is cancelled.")
    check = {"kind": "booking_absent", "booking_id": "B-300", "description": "booking B-300 no longer exists"}
    return Draft("travel_cancel", [phase], [check])


# ----------------------------------------------------------------------------------------------- checks


def _booking(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    bookings = world["travel"]["bookings"]
    if any(b["flight_id"] == check["flight_id"] and b["passenger"] == check["passenger"] for b in bookings):
        return None
    return f"no booking of {check['passenger']!r} on {check['flight_id']}"


def _booking_absent(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    ids = [b["booking_id"] for b in world["travel"]["bookings"]]
    return f"booking {check['booking_id']} still exists" if check["booking_id"] in ids else None


DOMAIN = Domain(
    name="travel",
    description="a travel agency",
    prefixes=("trip_", "air_", "travel_", "jet_"),
    tools=TOOLS,
    templates=(travel_book, travel_book, travel_cancel),
    initial_state=initial_state,
    checks={"booking": _booking, "booking_absent": _booking_absent},
)
