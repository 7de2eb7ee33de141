"""The bank domain: the user's accounts, balances, transfers and deposits.

World section ``bank``: ``accounts`` (name -> balance in dollars) and ``transfers``. Tasks: a transfer (the
target's balance maybe asked for afterwards), an overdraft the agent must report without moving money, a
balance lookup, a deposit. Check: ``balance``. Parameter kind ``money`` (variants may take cents).
"""

from __future__ import annotations

import random
from typing import Any

from k2lab.agentic.domains.base import (
    BaseTool,
    Codec,
    CodecOption,
    Domain,
    Draft,
    Param,
    Phase,
    Step,
    ToolError,
    money,
    string,
)

__all__ = ["ACCOUNTS", "DOMAIN"]

ACCOUNTS = ("checking", "savings", "travel", "rent")


def initial_state(rng: random.Random) -> dict[str, Any]:
    """The ``ACCOUNTS`` with distinct balances of 50-1990 dollars, no transfers."""
    balances = rng.sample(range(50, 2000, 10), len(ACCOUNTS))
    return {"accounts": {a: float(b) for a, b in zip(ACCOUNTS, balances, strict=True)}, "transfers": []}


# ------------------------------------------------------------------------------------------------ tools


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
    source, target, amount = args["source"], args["target"], money(args["amount"])
    balance = _account(world, source)
    _account(world, target)
    if amount <= 0:
        raise ToolError("invalid_amount", "the amount must be positive")
    if source == target:
        raise ToolError("same_account", "source and target are the same account")
    if amount > balance:
        raise ToolError("insufficient_funds", f"{source} holds {balance:.2f} USD, less than {amount:.2f}")
    accounts = world["bank"]["accounts"]
    accounts[source] = money(accounts[source] - amount)
    accounts[target] = money(accounts[target] + amount)
    world["bank"]["transfers"].append({"source": source, "target": target, "amount": amount})
    return {"status": "completed", "amount": amount, "source_balance": accounts[source], "currency": "USD"}


def deposit(world: dict[str, Any], args: dict[str, Any]) -> Any:
    name, amount = args["account"], money(args["amount"])
    _account(world, name)
    if amount <= 0:
        raise ToolError("invalid_amount", "the amount must be positive")
    accounts = world["bank"]["accounts"]
    accounts[name] = money(accounts[name] + amount)
    return {"account": name, "balance": accounts[name], "currency": "USD"}


def money_codecs() -> list[CodecOption]:
    """Amounts in cents."""
    cents = Codec(
        "scale",
        100.0,
        schema=(("type", "integer"), ("description", "Amount in US cents."), ("minimum", 0)),
        note="amounts in cents",
    )
    return [(cents, ("amount_cents", "cents", "value_cents"))]


ACCOUNT = Param(
    "account", string("Account name, e.g. 'checking'."), synonyms=("account_name", "acct", "account_id")
)
SOURCE = Param(
    "source", string("Account to debit."), synonyms=("from_account", "sender", "debit_account", "payer")
)
TARGET = Param(
    "target", string("Account to credit."), synonyms=("to_account", "recipient", "credit_account", "payee")
)
MONEY = Param(
    "amount",
    {"type": "number", "description": "Amount in US dollars.", "minimum": 0},
    kind="money",
    synonyms=("value", "sum", "amount_usd"),
)

TOOLS: tuple[BaseTool, ...] = (
    BaseTool("list_accounts", "bank", "accounts", "List the user's bank accounts.", (), list_accounts, True,
             "accounts", ("get_accounts", "show_accounts", "accounts_overview")),
    BaseTool("get_balance", "bank", "accounts", "Get an account's balance.", (ACCOUNT,), get_balance, True,
             aliases=("check_balance", "account_balance", "balance_inquiry")),
    BaseTool("transfer", "bank", "payments", "Transfer money between two accounts.", (SOURCE, TARGET, MONEY),
             transfer, aliases=("transfer_funds", "move_money", "send_money")),
    BaseTool("deposit", "bank", "payments", "Deposit money into an account.", (ACCOUNT, MONEY), deposit,
             aliases=("add_funds", "credit_account", "make_deposit")),
)  # fmt: skip


# ------------------------------------------------------------------------------------------------ tasks


def bank_transfer(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Transfer money between two accounts (the target's balance maybe asked for after)."""
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
    """A transfer beyond the source's balance: the agent reports the error, nothing moves."""
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
    """Look up one account's balance."""
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
    """Deposit money into one account."""
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


# ----------------------------------------------------------------------------------------------- checks


def _balance(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    value = world["bank"]["accounts"].get(check["account"])
    if value is None or abs(value - check["amount"]) > 0.005:
        return f"balance of {check['account']} is {value}, expected {check['amount']:.2f}"
    return None


DOMAIN = Domain(
    name="bank",
    description="personal bank accounts",
    prefixes=("bank_", "fin_", "ledger_", "acct_"),
    tools=TOOLS,
    templates=(bank_transfer, bank_transfer, bank_overdraft, bank_balance, bank_deposit),
    initial_state=initial_state,
    checks={"balance": _balance},
    param_kinds={"money": money_codecs},
)
