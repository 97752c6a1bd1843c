"""The README's code blocks run as written, so docs and CLI cannot drift apart.

* Every ``kvtool ...`` command line in a ``bash`` block is parsed by the real CLI (options,
  types, subcommands; optional parts in ``[...]`` included) without running it: an option
  the README documents but the command lacks fails here.
* The Python API block runs verbatim (slow: it calibrates, profiles and generates on the
  embedded kvref-5m) in a folder holding ``text.txt``, as the README says.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from kvtool.cli import app
from kvtool.cli_usage import click  # typer's vendored Click (its exceptions are not plain click's)
from tests.conftest import shared_path

README = Path(__file__).resolve().parent.parent / "README.md"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def kvtool_command_lines() -> list[str]:
    """``kvtool ...`` invocations of the bash blocks, comments dropped, ``[optional parts]`` kept."""
    lines = []
    for block in code_blocks("bash"):
        for line in block.splitlines():
            for part in line.split("&&"):
                part = part.split("  #")[0].strip()
                if part.startswith("kvtool "):
                    lines.append(part.replace("[", "").replace("]", ""))
    return lines


def parse(argv: list[str]):
    """Resolve subcommands and parse options as the CLI would, without invoking anything."""
    command = typer.main.get_command(app)
    ctx = command.make_context("kvtool", list(argv))
    while hasattr(command, "resolve_command"):  # a group: descend into the subcommand
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]  # the subcommand and its arguments
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
    return ctx


def test_the_readme_shows_commands():
    commands = {line.split()[1] for line in kvtool_command_lines()}
    assert {"run", "generate", "eval", "profile", "calibrate", "export", "inspect", "recipes"} <= commands


@pytest.mark.parametrize("line", kvtool_command_lines())
def test_every_readme_command_line_parses(line):
    argv = shlex.split(line)[1:]
    # Data slices are written unquoted in the README (``file.txt[0.9:1]``); bash passes them as they are.
    parse(argv)


def test_the_parser_catches_an_option_a_command_lacks():
    with pytest.raises(click.exceptions.UsageError, match="--chunk"):
        parse(["eval", "retrieval", "--recipe", "h2o", "--chunk", "8"])


@pytest.mark.slow
def test_python_api_block_runs_as_written(tmp_path, monkeypatch, capsys):
    text = shared_path("data/text/tinystories_val_head.txt")
    (tmp_path / "text.txt").write_text(text.read_text()[:200_000])
    monkeypatch.chdir(tmp_path)
    (block,) = code_blocks("python")
    exec(compile(block, "README.md (Python API)", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out
    assert "cache_bytes" in printed and "kept_fraction" in printed
    assert (tmp_path / "model.kvt.safetensors").is_file() and (tmp_path / "profile.safetensors").is_file()
