"""Command-line argument types with bounds, and a parser that answers in one line.

Every number a command line takes is checked when it is parsed, before anything starts:
finite, of its kind, within a range that names what is sane (a benchmark of 10**20
messages, a rate of NaN or a window of -1 are refused, not run).  Comma lists are
checked item by item and handed on as the same comma-separated text."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

from .errors import InvalidArgument
from .names import check_name

__all__ = [
    "ERROR_PREFIX",
    "Parser",
    "broker_name",
    "integer",
    "integers",
    "names",
    "number",
    "numbers",
    "out_file",
    "path",
]


#: how every error of the command line starts (the ``qosmq`` command, its subcommands
#: and the Spark jobs' entry points alike)
ERROR_PREFIX = "qosmq: error:"


class Parser(argparse.ArgumentParser):
    """Bad arguments: one line ``qosmq: error: what (see prog --help)``, exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{ERROR_PREFIX} {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _int(text: str, lo: int, hi: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number (expected {lo} to {hi})"
        ) from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"{value} is out of range (expected {lo} to {hi})")
    return value


def _float(text: str, lo: float, hi: float, *, above: bool) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    low_ok = value > lo if above else value >= lo
    if not (math.isfinite(value) and low_ok and value <= hi):
        bound = f"above {lo:g}" if above else f"from {lo:g}"
        raise argparse.ArgumentTypeError(f"{text!r} is out of range (expected {bound} to {hi:g})")
    return value


def integer(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        return _int(text, lo, hi)

    parse.__name__ = "integer"
    return parse


def number(lo: float, hi: float, *, above: bool = False) -> Callable[[str], float]:
    """A finite number in [lo, hi] (``above``: in (lo, hi])."""

    def parse(text: str) -> float:
        return _float(text, lo, hi, above=above)

    parse.__name__ = "number"
    return parse


def _items(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list (e.g. 1,2,3)")
    return items


def integers(lo: int, hi: int, most: int = 64) -> Callable[[str], str]:
    """A comma list of whole numbers in [lo, hi], at most ``most`` of them."""

    def parse(text: str) -> str:
        items = _items(text)
        if len(items) > most:
            raise argparse.ArgumentTypeError(f"at most {most} values, got {len(items)}")
        return ",".join(str(_int(item, lo, hi)) for item in items)

    parse.__name__ = "comma list"
    return parse


def numbers(lo: float, hi: float, *, above: bool = False, most: int = 64) -> Callable[[str], str]:
    """A comma list of finite numbers in [lo, hi] (``above``: in (lo, hi])."""

    def parse(text: str) -> str:
        items = _items(text)
        if len(items) > most:
            raise argparse.ArgumentTypeError(f"at most {most} values, got {len(items)}")
        return ",".join(f"{_float(item, lo, hi, above=above):g}" for item in items)

    parse.__name__ = "comma list"
    return parse


def names(choices: Iterable[str]) -> Callable[[str], str]:
    """A comma list of names from ``choices``."""
    allowed = tuple(choices)

    def parse(text: str) -> str:
        items = _items(text)
        unknown = [item for item in items if item not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))} (choose from {', '.join(allowed)})"
            )
        return ",".join(items)

    parse.__name__ = "comma list"
    return parse


def broker_name(most_bytes: int) -> Callable[[str], str]:
    """A name the broker will carry (a topic, a queue): not empty, no control
    characters, valid UTF-8 of at most ``most_bytes`` bytes (AMQP names end at 255
    bytes, and the layer adds suffixes to some): ``names.check_name``."""

    def parse(text: str) -> str:
        try:
            return check_name(text, "the name", most_bytes)
        except InvalidArgument as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "name"
    return parse


def path(text: str) -> Path:
    """A file or folder name; an empty one is refused (``Path("")`` would be the cwd)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (expected a file or folder name)")
    return Path(text)


def out_file(text: str) -> Path:
    """A file a command writes its results to: its folder must exist now, so a run never
    ends by losing its records to a typo."""
    p = path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{p} is a folder (expected a file name)")
    if not p.parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {p.parent} does not exist (for {p})")
    return p
