"""The calendar domain: a personal week calendar of titled one-hour events.

World section ``calendar``: ``events`` (title, day, hour), one ``standup`` on Monday at 9 to begin with.
Tasks: create an event (the hour maybe held back, the day's agenda maybe asked for afterwards), move one,
cancel one. Checks: ``event_at``, ``event_absent``. Parameter kind ``hour`` (variants may take minutes
after midnight or ``HH:00``).
"""

from __future__ import annotations

import random
from typing import Any

from k2lab.agentic.domains.base import (
    DAY,
    DAYS,
    OPTIONAL_DAY,
    BaseTool,
    Clarification,
    Codec,
    CodecOption,
    Domain,
    Draft,
    Param,
    Phase,
    Step,
    ToolError,
    clarify,
    day_name,
    integer,
    string,
)

__all__ = ["DOMAIN", "TITLES"]

#: Titles of the events tasks create, move or cancel.
TITLES = ("dentist", "team sync", "yoga", "1:1 with Sam", "budget review", "lunch with Mia")


def initial_state(rng: random.Random) -> dict[str, Any]:
    """One event: the Monday standup at 9."""
    return {"events": [{"title": "standup", "day": "mon", "hour": 9}]}


# ------------------------------------------------------------------------------------------------ tools


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


def hour_codecs() -> list[CodecOption]:
    """Start times as minutes after midnight, or as ``HH:00``."""
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
    return [(minutes, ("start_minute", "minute_of_day")), (clock, ("start_time", "at"))]


TITLE = Param("title", string("The event's title."), synonyms=("name", "event_title", "summary", "subject"))
HOUR = Param(
    "hour",
    integer("Start hour, 0-23.", 0, 23),
    kind="hour",
    synonyms=("start_hour", "at_hour", "hour_of_day"),
)

TOOLS: tuple[BaseTool, ...] = (
    BaseTool("create_event", "calendar", "events", "Create a calendar event.", (TITLE, DAY, HOUR),
             create_event, aliases=("add_event", "schedule_event", "new_meeting")),
    BaseTool("list_events", "calendar", "events", "List calendar events, optionally of one day.",
             (OPTIONAL_DAY,), list_events, True, "events", ("get_events", "show_calendar", "agenda")),
    BaseTool("delete_event", "calendar", "events", "Delete an event by title.", (TITLE,), delete_event,
             aliases=("remove_event", "cancel_event", "drop_meeting")),
    BaseTool("move_event", "calendar", "events", "Move an event to another day and hour.", (TITLE, DAY, HOUR),
             move_event, aliases=("reschedule_event", "update_event_time", "shift_meeting")),
)  # fmt: skip


# ------------------------------------------------------------------------------------------------ tasks


def _free_slot(rng: random.Random, world: dict[str, Any]) -> tuple[str, int]:
    taken = {(e["day"], e["hour"]) for e in world["calendar"]["events"]}
    while True:
        slot = (rng.choice(DAYS), rng.randint(8, 18))
        if slot not in taken:
            return slot


def _event_at_check(title: str, day: str, hour: int) -> dict[str, Any]:
    """The ``event_at`` check of an event that should end up on ``day`` at ``hour``."""
    return {
        "kind": "event_at",
        "title": title,
        "day": day,
        "hour": hour,
        "description": f"'{title}' is on {day} at {hour}:00",
    }


def calendar_create(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Create an event in a free slot (the hour maybe held back; the day's agenda maybe asked for after)."""
    title = rng.choice(TITLES)
    day, hour = _free_slot(rng, world)
    steps = [Step("create_event", {"title": title, "day": day, "hour": hour})]
    answer = f"Added '{title}' on {day_name(day)} at {hour:02d}:00."
    if clarify(rng):
        clarification = Clarification(
            "hour", "What time should it start?", ["time", "hour", "when"], f"At {hour:02d}:00."
        )
        phase = Phase(f"Add '{title}' to my calendar on {day_name(day)}.", steps, answer, clarification)
    else:
        phase = Phase(f"Put '{title}' on my calendar for {day_name(day)} at {hour:02d}:00.", steps, answer)
    check = _event_at_check(title, day, hour)
    phases = [phase]
    if rng.random() < 0.35:
        others = sorted(e["title"] for e in world["calendar"]["events"] if e["day"] == day)
        listed = ", ".join(f"'{t}'" for t in [*others, title])
        follow = Phase(
            f"What's on my calendar that {day_name(day)} now?",
            [Step("list_events", {"day": day})],
            f"On {day_name(day)} you have: {listed}.",
            terms=[*others, title],
        )
        phases.append(follow)
    return Draft("calendar_create", phases, [check])


def calendar_move(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Move an event (put on the calendar first) to another free slot."""
    title = rng.choice(TITLES)
    old_day, old_hour = _free_slot(rng, world)
    world["calendar"]["events"].append({"title": title, "day": old_day, "hour": old_hour})
    day, hour = _free_slot(rng, world)
    steps = [Step("move_event", {"title": title, "day": day, "hour": hour})]
    answer = f"Moved '{title}' to {day_name(day)} at {hour:02d}:00."
    request = f"Please move my '{title}' to {day_name(day)} at {hour:02d}:00."
    check = _event_at_check(title, day, hour)
    return Draft("calendar_move", [Phase(request, steps, answer)], [check])


def calendar_delete(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Cancel an event put on the calendar first."""
    title = rng.choice(TITLES)
    day, hour = _free_slot(rng, world)
    world["calendar"]["events"].append({"title": title, "day": day, "hour": hour})
    steps = [Step("delete_event", {"title": title})]
    check = {"kind": "event_absent", "title": title, "description": f"no event titled '{title}' remains"}
    return Draft(
        "calendar_delete", [Phase(f"Cancel '{title}', please.", steps, f"Deleted '{title}'.")], [check]
    )


# ----------------------------------------------------------------------------------------------- checks


def _event(world: dict, title: str) -> dict | None:
    return next((e for e in world["calendar"]["events"] if e["title"] == title), None)


def _event_at(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    event = _event(world, check["title"])
    if event is None:
        return f"no event titled {check['title']!r}"
    if (event["day"], event["hour"]) != (check["day"], check["hour"]):
        found, wanted = f"{event['day']} {event['hour']}:00", f"{check['day']} {check['hour']}:00"
        return f"{check['title']!r} is on {found}, expected {wanted}"
    return None


def _event_absent(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    return f"{check['title']!r} is still on the calendar" if _event(world, check["title"]) else None


DOMAIN = Domain(
    name="calendar",
    description="a personal calendar",
    prefixes=("cal_", "agenda_", "planner_", "sched_"),
    tools=TOOLS,
    templates=(calendar_create, calendar_create, calendar_move, calendar_delete),
    initial_state=initial_state,
    checks={"event_at": _event_at, "event_absent": _event_absent},
    param_kinds={"hour": hour_codecs},
)
