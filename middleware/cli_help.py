"""Help that shows every option's default: one formatter for every ``qosmq`` parser."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection, Mapping

__all__ = [
    "DefaultsFormatter",
    "apply_everywhere",
    "not_for",
    "renamed",
    "undocumented",
]


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; each option's help ends with its default, unless the
    help already says it or the option has none worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default in (None, False, argparse.SUPPRESS)
            or isinstance(action, argparse._HelpAction | argparse._VersionAction)
        ):
            return text
        return f"{text} (default: %(default)s)"


def apply_everywhere(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every command parser under it the formatter."""
    parser.formatter_class = DefaultsFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                apply_everywhere(command)


def undocumented(parser: argparse.ArgumentParser, path: str = "qosmq") -> list[str]:
    """Options anywhere under ``parser`` without a help text (for the test)."""
    out: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                out += undocumented(command, f"{path} {name}")
        elif action.option_strings and not action.help:
            out.append(f"{path} {action.option_strings[0]}")
    return out


class _Renamed(argparse.Action):
    """An option's former name: still taken (into the new one's ``dest``), with a note
    naming the new one; not shown in ``--help``."""

    def __init__(self, option_strings: list[str], dest: str, new: argparse.Action, **kw: object):
        self.new = new
        flag = isinstance(new, argparse._StoreTrueAction)
        convert = None if flag or isinstance(new.type, str) else new.type
        super().__init__(
            option_strings,
            dest,
            nargs=0 if flag else None,
            type=convert,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(
            f"qosmq: note: {option_string} is now {self.new.option_strings[0]}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def renamed(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Keep ``old`` working as ``new`` (an option renamed to one name per concept)."""
    action = parser._option_string_actions[new]
    parser.add_argument(old, dest=action.dest, action=_Renamed, new=action)


def not_for(
    args: argparse.Namespace,
    parser_defaults: Mapping[str, object],
    owners: Mapping[str, Collection[str]],
    chosen: str,
    what: str = "--experiment",
) -> str | None:
    """The first option given (not at its default) that only ``owners[dest]`` use and
    ``chosen`` is not among, as a one-line reason; None when every option applies."""
    for dest, users in owners.items():
        if chosen in users:
            continue
        value = getattr(args, dest, None)
        if value is not None and value != parser_defaults.get(dest):
            flag = "--" + dest.replace("_", "-")
            return f"{flag} is for {what} {'/'.join(sorted(users))}, not {chosen}"
    return None
