"""Usage errors (unknown option, missing option, bad value, unknown command) as one `error:` line.

Typer/Click print usage errors as a multi-line box; kvtool promises one line and exit
status 2 for every error. `OneLineErrorsGroup` is the root command's class: it runs Click
in non-standalone mode and prints Click's own message, reworded, with the help command of
the command that raised it:

    error: no such option --foo; see kvtool generate --help
"""

from __future__ import annotations

import re
import sys

from rich.console import Console
import typer
from rich.markup import escape
from typer.core import TyperGroup

try:  # typer >= 0.20 vendors Click as typer._click; its exceptions are not click's
    from typer import _click as click
except ImportError:  # pragma: no cover - older typer on plain Click
    import click

PROG_NAME = "kvtool"
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def usage_message(exc, fallback_path: str = PROG_NAME) -> str:
    """Click's message in one line, lower-case first letter, no final period, plus where help is."""
    text = " ".join(exc.format_message().split())
    text = re.sub(r"^No such option: (\S+)", r"no such option \1", text)
    text = re.sub(r"\(Possible options: ([^)]*)\)", lambda m: f"(did you mean {_either(m[1])}?)", text)
    text = re.sub(r": Input should be", ": input should be", text)  # typer's pydantic coercion messages
    text = text[:1].lower() + text[1:]
    text = text.rstrip(".")
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else fallback_path
    return f"{text}; see {path} --help"


def _either(options: str) -> str:
    """'--model, --sample' -> '--model or --sample'."""
    parts = [part.strip() for part in options.split(",")]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"


class OneLineErrorsGroup(TyperGroup):
    """The root `kvtool` group: Click usage errors become one `error:` line and exit status 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Run the CLI as `kvtool` (whatever argv[0] or a test runner says); see the class docstring."""
        try:
            result = super().main(args=args, prog_name=PROG_NAME, complete_var=complete_var,
                                  standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as exc:  # `kvtool` or `kvtool eval` alone: the help, as before
            print(exc.ctx.get_help())
            result = 2
        except click.exceptions.ClickException as exc:
            message = usage_message(exc, self._command_path(args))
            Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
            result = 2 if isinstance(exc, click.exceptions.UsageError) else exc.exit_code
        except typer.Abort:
            Console(stderr=True).print("[bold red]error:[/] aborted", highlight=False)
            result = 1
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)

    def _command_path(self, args) -> str:
        """'kvtool eval ppl' from the leading command names in args (for errors raised without a context)."""
        path, group = [PROG_NAME], self
        for arg in list(sys.argv[1:] if args is None else args):
            command = getattr(group, "commands", {}).get(arg)
            if command is None:
                break
            path.append(arg)
            group = command
        return " ".join(path)
