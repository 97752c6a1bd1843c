"""The README's code blocks run as written, so docs and CLI cannot drift apart.

* Every ``kvtool ...`` command line in a ``bash`` block is parsed by the real CLI (options,
  types, subcommands; optional parts in ``[...]`` included) without running it: an option
  the README documents but the command lacks fails here (fast).
* Every command line of the ``bash`` blocks is then *run*, in order, in a folder beside a
  ``shared/`` link as the README assumes (slow: about two minutes on 2 idle cores), and what
  the README says it shows is checked (files written, compression shown, a model that can
  do the retrieval task). ``kvtool`` lines run in-process through the CLI runner, other
  lines (``cp``, ``python -m ...``) through bash. What is not run, and why: the install and
  the test command (CI runs them), ``kvtool plan`` and the calibration of its output (a plan
  over every bundled recipe takes minutes; tests/test_plan.py runs it on small settings), the
  quick start's ``kvtool run`` (the README's first command ran the same job just before),
  ``kvtool fit-windows`` (the stand-in model has no sliding-window layers; tests/test_window_fit.py
  runs the command on a tiny Gemma 3).
  Stand-ins: ``M`` is the embedded kvref-5m; ``push`` writes to a local folder standing in
  for the hub, which the test then lays out as a download would have (tests/test_hub.py).
* The Python API block runs verbatim (slow: it calibrates, profiles and generates on the
  embedded kvref-5m) in a folder holding ``text.txt``, as the README says.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.cli_usage import click  # typer's vendored Click (its exceptions are not plain click's)
from tests.conftest import shared_path
from tests.test_hub import FolderHub, publish_to_cache

README = Path(__file__).resolve().parent.parent / "README.md"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def bash_command_lines() -> list[str]:
    """Every command line of the bash blocks in order: comments dropped, ``a && b`` split."""
    lines = []
    for block in code_blocks("bash"):
        for line in block.splitlines():
            for part in line.split("&&"):
                part = part.split("  #")[0].strip()
                if part and not part.startswith("#"):
                    lines.append(part)
    return lines


def kvtool_command_lines() -> list[str]:
    """``kvtool ...`` invocations of the bash blocks, comments dropped, ``[optional parts]`` kept."""
    return [without_optional_brackets(line) for line in bash_command_lines() if line.startswith("kvtool ")]


def without_optional_brackets(line: str) -> str:
    """``kvtool x [--opt v]`` -> ``kvtool x --opt v``; data slices such as ``text.txt[0.9:1]`` stay."""
    return re.sub(r"\[(--[^]]*)\]", r"\1", line)


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


# -- running the bash blocks -------------------------------------------------------------------

NOT_RUN = (  # (start of line, why): see the module docstring
    ("pip install", "the install: CI runs it"),
    ("python -m pytest", "the test suite itself"),
    ("kvtool plan", "minutes over every bundled recipe: tests/test_plan.py"),
    ("kvtool run       --data text.txt --out-dir kvtool-run", "the README's first command ran the same job (the same text, the default out-dir kvtool-run)"),
    ("kvtool calibrate --data text.txt --model M --recipe plan/", "needs the plan's output"),
    ("kvtool fit-windows", "needs a model with sliding-window layers (M has none): tests/test_window_fit.py runs it on a tiny Gemma 3"),
    ("python -m venv /tmp/vllm-venv", "vLLM's own environment (~1 GB, minutes): tests/test_export_vllm.py checks its comparison"),
    ("/tmp/vllm-venv/bin/", "runs in vLLM's environment (RESULTS.md: 'A real vLLM loads the fp8 export')"),
)

# What the README says a command shows, checked on its output (line prefix -> substrings).
SHOWS = {
    "kvtool generate  --artifact model.kvt.safetensors --prompt \"Once": ["256 new tokens x 1"],
    "kvtool generate  --artifact model.kvt.safetensors --prompt \"A\"": ["256 new tokens x 2"],
    "kvtool eval retrieval --model copy-model --task copy --recipe h2o": ["16-bit cache 1.000", "wrote grid.png"],
    "kvtool eval retrieval --model copy-model --task copy --recipe snapkv": ["16-bit cache 1.000"],
    "kvtool eval ppl": ["delta vs 16-bit"],
    "kvtool eval pool": ["kivi-2bit: 2 sets", "95% interval", "<= +3%?"],
    "kvtool run": ["perplexity compressed", "x smaller"],
    "kvtool card": ["## kvtool KV-cache compression", "text.txt"],
    "kvtool push": ["you/smollm2-kvquant3:model.kvt.safetensors"],
}
NEVER_SHOWS = ["nothing compressed yet", "cannot do the"]  # README examples show compression on a model that can do the task

WRITES = {  # line prefix -> files the command must leave
    "kvtool profile   --data text.txt": ["profile.safetensors", "map.png"],
    "kvtool calibrate --data text.txt --recipe kivi-4bit": ["calib.safetensors"],
    "kvtool export    --calib calib.safetensors": ["model.kvt.safetensors"],
    "kvtool export    --calib fp8calib.safetensors": ["served-model/config.json"],
    "kvtool eval ppl  --artifact": ["ppl.json"],
    "kvtool eval pool set1.json": ["pooled.json", "forest.png"],
    "python -m kvtool.eval.copy_model": ["copy-model/config.json"],
    "kvtool run --data ../shared/data/text/wikitext2_test.txt": ["kvtool-run/model.kvt.safetensors"],
    "kvtool calibrate --data text.txt --model M --recipe kvquant": ["calib.safetensors"],
    "kvtool pull": ["model.kvt.safetensors"],
}


def cache_ratios(output: str) -> list[float]:
    """The 'ratio' column of generate's cache table (16-bit cache bytes / bytes held)."""
    ratios = [float(value) for value in re.findall(r"│\s*([0-9.]+)x\s*│", output)]
    assert ratios, f"no cache table in the output:\n{output[-3000:]}"
    return ratios


def test_bash_lines_cover_every_command_and_the_skips_are_few():
    lines = bash_command_lines()
    skipped = [line for line in lines if any(line.startswith(prefix) for prefix, _ in NOT_RUN)]
    assert len(lines) >= 25 and len(skipped) <= 10  # pip (2), pytest, plan and its calibration, vLLM's env (3), run again, fit-windows
    assert all(any(line.startswith(prefix) for line in skipped) for prefix, _ in NOT_RUN)
    for prefix in [*SHOWS, *WRITES]:  # a check whose line left the README must not pass silently
        assert any(line.startswith(prefix) for line in lines), prefix


@pytest.mark.slow
def test_readme_command_lines_run_as_written(tmp_path, monkeypatch):
    shared = shared_path("data/text/wikitext2_test.txt").parents[2]
    workdir = tmp_path / "kvtool"
    workdir.mkdir()
    (tmp_path / "shared").symlink_to(shared)  # ../shared, as beside the checkout
    monkeypatch.chdir(workdir)
    import huggingface_hub
    import huggingface_hub.constants

    hub_root = tmp_path / "hub"

    class FolderHubApi(FolderHub):  # `HfApi(token=...)` as kvtool.hub.push makes it
        def __init__(self, token=None, **kwargs):
            super().__init__(hub_root)

    monkeypatch.setattr(huggingface_hub, "HfApi", FolderHubApi)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model_m = str(Path(__file__).resolve().parent.parent / "kvtool" / "default_model")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    runner = CliRunner()
    ran = []
    for line in bash_command_lines():
        if any(line.startswith(prefix) for prefix, _ in NOT_RUN):
            continue
        started = time.perf_counter()
        argv = shlex.split(without_optional_brackets(line))  # optional parts `[--opt v]` included
        argv = [model_m if (arg == "M" and argv[i - 1] == "--model") else arg for i, arg in enumerate(argv)]
        if argv[0] == "kvtool":
            result = runner.invoke(app, argv[1:], catch_exceptions=False)
            output, code = result.output, result.exit_code
        else:
            done = subprocess.run(["bash", "-c", shlex.join(argv)], env=env, capture_output=True, text=True)
            output, code = done.stdout + done.stderr, done.returncode
        assert code == 0, f"README line failed: {line}\n{output[-3000:]}"
        for prefix, expected in SHOWS.items():
            if line.startswith(prefix):
                for text in expected:
                    assert text in " ".join(output.split()), f"{line}: output lacks {text!r}\n{output[-3000:]}"
        if line.startswith("kvtool generate"):
            assert min(cache_ratios(output)) > 1.5, f"{line}: the cache is not shown smaller\n{output[-3000:]}"
        for text in NEVER_SHOWS:
            assert text not in " ".join(output.split()), f"{line}: output says {text!r}\n{output[-3000:]}"
        for prefix, files in WRITES.items():
            if line.startswith(prefix):
                for name in files:
                    assert (workdir / name).exists(), f"{line}: did not write {name}"
        if line.startswith("kvtool push"):  # what a download by hub id would have cached
            publish_to_cache(tmp_path / "hub-cache", hub_root, "you/smollm2-kvquant3")
        ran.append(line)
        print(f"{time.perf_counter() - started:6.1f} s  {line}")
    assert len(ran) >= 26  # every line but those of NOT_RUN
