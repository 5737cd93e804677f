"""Help that shows every option's default: one formatter for every ``qosmq`` parser."""

from __future__ import annotations

import argparse

__all__ = ["DefaultsFormatter", "apply_everywhere", "undocumented"]


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
