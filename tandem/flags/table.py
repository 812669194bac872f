"""Flags as data: one `Flag` per option, one `FlagTable` per concern.

Every command of `tandem` builds its parser from tables (engine, server, router placement,
resilience, accounting, bench traffic, ...), each kept beside the code that turns the parsed
values into that concern's config dataclass. A table is the one place that knows an option's
spelling, default, type and help, so the same table registers it with argparse, lists its
defaults, reads its values back out of a namespace and turns them into argv again: code that
forwards "the flags the user set" to a child process (`tandem up`, the benches) never reads
argparse's private state, and a command that offers only part of a concern (`tandem up`
takes three of the routing-policy flags) takes a `subset` of the same table, so the two
commands cannot drift apart.

Validation of the built config belongs to the command (`Command.check`), run once the whole
command line is parsed, so a bad combination is one `parser.error` line before any process
starts. Imports argparse only: the router's process builds its parser from these too.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace
from typing import Any

# A parser or one of its argument groups: both take add_argument.
ArgumentContainer = argparse.ArgumentParser | argparse._ArgumentGroup


@dataclass(frozen=True)
class Flag:
    """One option (or positional) as argparse registers it and as argv writes it back.

    `option` is "--name" for an option, a bare name for a positional. `switch` is the common
    store_true; `action` covers the rest argparse offers ("append", "store_false").
    """

    option: str
    help: str | None = None
    default: Any = None
    type: Callable[[str], Any] | None = None
    choices: Iterable[Any] | None = None
    metavar: str | None = None
    switch: bool = False  # store_true: present or absent, no value
    action: str | None = None
    nargs: str | int | None = None
    dest_name: str | None = None  # when the dest is not the option's name
    short: str | None = None  # e.g. "-p", listed before `option`
    required: bool = False

    @property
    def positional(self) -> bool:
        return not self.option.startswith("-")

    @property
    def dest(self) -> str:
        if self.dest_name is not None:
            return self.dest_name
        return self.option.lstrip("-").replace("-", "_")

    @property
    def initial(self) -> Any:
        """The value a parse without this flag leaves in the namespace."""
        if self.switch and self.default is None:
            return False
        if self.action == "store_false" and self.default is None:
            return True
        return self.default

    def add_to(self, container: ArgumentContainer) -> argparse.Action:
        names = [self.option] if self.short is None else [self.short, self.option]
        kwargs: dict[str, Any] = {"help": self.help}
        if self.dest_name is not None:
            kwargs["dest"] = self.dest_name
        if self.required:
            kwargs["required"] = True
        if self.switch or self.action in ("store_true", "store_false"):
            kwargs["action"] = self.action or "store_true"
            if self.default is not None:
                kwargs["default"] = self.default
            return container.add_argument(*names, **kwargs)
        if self.action is not None:
            kwargs["action"] = self.action
        default = list(self.default) if isinstance(self.default, list) else self.default
        kwargs.update(default=default, type=self.type, choices=self.choices, metavar=self.metavar)
        if self.nargs is not None:
            kwargs["nargs"] = self.nargs
        return container.add_argument(*names, **kwargs)

    def to_argv(self, value: Any) -> list[str]:
        """The flag as a command line would give `value` (nothing for None or an unset switch)."""
        if self.positional:
            return [] if value is None else [str(value)]
        if self.switch or self.action == "store_true":
            return [self.option] if value else []
        if self.action == "store_false":
            return [] if value else [self.option]
        if value is None:
            return []
        if self.action == "append" or self.nargs in ("+", "*"):
            values = list(value)
            if self.action == "append":
                return [part for item in values for part in (self.option, str(item))]
            return [self.option, *map(str, values)] if values else []
        return [self.option, str(value)]


@dataclass(frozen=True)
class FlagTable:
    """The flags of one concern, in --help order; `title` names their argparse group (None:
    the parser's own options and positionals, outside any group)."""

    title: str | None
    flags: tuple[Flag, ...]

    def __iter__(self):  # noqa: ANN204 - Iterator[Flag]
        return iter(self.flags)

    def __getitem__(self, option: str) -> Flag:
        for flag in self.flags:
            if flag.option == option:
                return flag
        raise KeyError(option)

    def add_to(self, parser: argparse.ArgumentParser,
               group: argparse._ArgumentGroup | None = None) -> ArgumentContainer:
        """Register every flag, in a new group titled `title` unless `group` is given (flags of
        two tables sharing one group); returns where they went."""
        container: ArgumentContainer
        if group is not None:
            container = group
        elif self.title is None:
            container = parser
        else:
            container = parser.add_argument_group(self.title)
        for flag in self.flags:
            flag.add_to(container)
        return container

    def subset(self, options: Collection[str]) -> FlagTable:
        """The flags named in `options`, in this table's order (a command offering part of a
        concern)."""
        missing = set(options) - {flag.option for flag in self.flags}
        if missing:
            raise KeyError(f"not in the {self.title!r} table: {sorted(missing)}")
        return replace(self, flags=tuple(f for f in self.flags if f.option in options))

    def without(self, options: Collection[str]) -> FlagTable:
        return self.subset([f.option for f in self.flags if f.option not in options])

    def defaults(self) -> dict[str, Any]:
        """dest -> the value a parse leaves when the flag is not given."""
        return {flag.dest: flag.initial for flag in self.flags}

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """dest -> value in `args` (the default where a command lacks the flag)."""
        return {flag.dest: getattr(args, flag.dest, flag.initial) for flag in self.flags}

    def argv(self, args: argparse.Namespace, exclude: Collection[str] = (),
             changed_only: bool = True) -> list[str]:
        """The flags as argv again: those set to something other than their default (every one
        with `changed_only=False`), skipping the options in `exclude`."""
        argv: list[str] = []
        for flag in self.flags:
            value = getattr(args, flag.dest, flag.initial)
            if flag.option in exclude or (changed_only and value == flag.initial):
                continue
            argv += flag.to_argv(value)
        return argv


@dataclass(frozen=True)
class Command:
    """What a subcommand leaves in its namespace: the handler that runs it and the check that
    builds (and so validates) its configs first. A check raises ValueError with one line;
    `tandem.cli.main` reports it through `parser.error` (exit 2) before anything starts."""

    handler: Callable[[argparse.Namespace], int]
    check: Callable[[argparse.Namespace], object] | None = None

    def install(self, parser: argparse.ArgumentParser) -> None:
        parser.set_defaults(handler=self.handler)
        if self.check is not None:
            parser.set_defaults(check=self.check)


def check_args(args: argparse.Namespace) -> None:
    """Run the parsed command's check, if it has one (ValueError: an invalid combination)."""
    check = getattr(args, "check", None)
    if check is not None:
        check(args)
