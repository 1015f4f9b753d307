"""``miles-fsm``'s usage errors: one line on stderr, naming the subcommand and where its help is; exit 2.

Run as a user runs them (a fresh ``python -m miles_fsm``), so the exit code and the exact stderr are
the ones a shell sees. ``--help`` stays the full help, and ``--version`` prints the installed version.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

SUBCOMMANDS = ("bench", "demo", "diagram", "replay")


def _cli(*argv: str, module: str = "miles_fsm") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip


def _one_line_usage_error(done: subprocess.CompletedProcess[str], prog: str, says: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stdout == "", done.stdout
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("\n"), done.stderr
    line = done.stderr.rstrip("\n")
    assert line.startswith(f"{prog}: error: "), line
    assert says in line, line
    assert line.endswith(f"see {prog} --help"), line


@pytest.mark.parametrize(
    ("argv", "prog", "says"),
    [
        # the top level: an unknown subcommand, none at all, an unknown flag
        (["frob"], "miles-fsm", "invalid choice: 'frob'"),
        ([], "miles-fsm", "the following arguments are required: COMMAND"),
        (["--bogus"], "miles-fsm", "--bogus"),
        (["--bogus", "diagram"], "miles-fsm", "unrecognized arguments: --bogus"),
        # a flag the subcommand does not have
        *[(["sub", "--bogus"], f"miles-fsm {s}", "unrecognized arguments: --bogus") for s in SUBCOMMANDS if s != "replay"],
        (["replay", "DIR", "--bogus"], "miles-fsm replay", "unrecognized arguments: --bogus"),
        # a missing argument, or a flag missing its value
        (["replay"], "miles-fsm replay", "the following arguments are required: dir"),
        (["demo", "--ranks"], "miles-fsm demo", "argument --ranks: expected one argument"),
        (["bench", "--out"], "miles-fsm bench", "argument --out: expected one argument"),
        (["diagram", "--mermaid=yes"], "miles-fsm diagram", "argument --mermaid: ignored explicit argument 'yes'"),
        # a value of the wrong type, or out of the parser's range
        (["demo", "--ranks", "two"], "miles-fsm demo", "argument --ranks: invalid int value: 'two'"),
        (["demo", "--mode", "sideways"], "miles-fsm demo", "argument --mode: invalid choice: 'sideways'"),
        (["replay", "DIR", "--epoch", "5:2"], "miles-fsm replay", "the range is empty"),
        (["bench", "--cycles", "0"], "miles-fsm bench", "argument --cycles: must be at least 1, got 0"),
        # a value the demo refuses after parsing
        (["demo", "--ranks", "0"], "miles-fsm demo", "--ranks must be in 1..64"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_usage_error_is_one_line_naming_the_subcommand_and_its_help(argv, prog, says):
    argv = [a if a != "sub" else prog.split()[1] for a in argv]
    _one_line_usage_error(_cli(*argv), prog, says)


@pytest.mark.slow
def test_the_module_entries_print_the_same_one_line():
    """``python -m miles_fsm.apps.demo`` and ``python -m miles_fsm.apps.bench`` are the subcommands by
    another name: the same one line, under the subcommand's name."""
    _one_line_usage_error(_cli("--bogus", module="miles_fsm.apps.demo"), "miles-fsm demo", "--bogus")
    _one_line_usage_error(_cli("--bogus", module="miles_fsm.apps.bench"), "miles-fsm bench", "--bogus")


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_help_stays_the_full_help(sub):
    """``--help``: the usage line and every option, on stdout, exit 0."""
    done = _cli(sub, "--help")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith(f"usage: miles-fsm {sub} "), done.stdout
    assert "--help" in done.stdout and len(done.stdout.splitlines()) > 3


def test_version_prints_the_installed_version():
    """``miles-fsm --version``: the installed distribution's version (package metadata), exit 0."""
    done = _cli("--version")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == f"miles-fsm {importlib.metadata.version('miles-fsm')}\n"
    assert "--version" in _cli("--help").stdout


def test_every_flag_the_readme_lists_is_one_the_command_has(capsys):
    """The README's command table stays true: each ``--flag`` of a ``miles-fsm SUB`` row is in SUB's --help."""
    import re
    from pathlib import Path

    from miles_fsm.apps.cli import main

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = re.findall(r"^\| `(miles-fsm [^|]*?(?:\\\|[^|]*?)*)` \|", readme, flags=re.M)
    listed: dict[str, set[str]] = {}
    for cell in rows:
        for command in re.findall(r"miles-fsm (\w+)([^`]*)", cell):
            listed.setdefault(command[0], set()).update(re.findall(r"--[a-z][a-z-]*", command[1]))
    assert set(listed) == set(SUBCOMMANDS), listed
    for sub, flags in listed.items():
        with pytest.raises(SystemExit) as done:
            main([sub, "--help"])
        assert done.value.code == 0
        help_text = capsys.readouterr().out
        missing = sorted(f for f in flags if f not in help_text)
        assert not missing, f"README lists {missing} for miles-fsm {sub}, which has no such flag"
