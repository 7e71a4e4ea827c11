"""The `kvtier` command itself: help without a subcommand, --version, typo'd flags; every
subcommand's flags (help with defaults, one metavar style, choices rejected before torch
loads, --log-level); a bad --disk is one line."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

import pytest

from engine import SamplingParams
from harness import process
from kvstore.codecs import CODEC_NAMES
from kvtier import __version__
from kvtier.cli import build_parser, main
from kvtier.cli_help import device_arg, help_with_default
from kvtier.log_setup import configure_logging

REPO = Path(__file__).resolve().parents[2]


def test_bare_kvtier_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvtier") and "serve" in out and "cache-server" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kvtier {__version__}"


def test_typo_flag_names_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--prot", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: kvtier serve" in err and "unrecognized arguments: --prot 3" in err


def test_serve_refuses_an_empty_api_key_and_a_bad_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--api-key", " "]) == 2
    assert "--api-key" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err


# ---- every flag of every subcommand ---------------------------------------------------------

METAVAR_STYLE = re.compile(r"^[A-Z][A-Z0-9_]*$")


def option_actions() -> list[tuple[str, argparse.Action]]:
    """(subcommand, action) for every option of every subcommand, --help excepted."""
    _, subparsers = build_parser()
    return [(name, a) for name, p in subparsers.items() for a in p._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_flag_has_help_showing_its_default() -> None:
    actions = option_actions()
    assert {name for name, _ in actions} >= {"generate", "serve", "cache-server"}
    for name, a in actions:
        assert a.help, f"kvtier {name} {a.option_strings[0]} has no help"
        shown = help_with_default(a)
        assert shown.count("(default: ") == 1, f"kvtier {name} {a.option_strings[0]}: {shown!r}"


def test_one_metavar_style_and_choices_for_fixed_vocabularies() -> None:
    for name, a in option_actions():
        if a.nargs == 0:
            continue  # a switch takes no value
        flag = f"kvtier {name} {a.option_strings[0]}"
        if a.choices is not None:
            assert a.metavar is None, f"{flag}: a fixed vocabulary shows its choices"
        else:
            assert isinstance(a.metavar, str) and METAVAR_STYLE.match(a.metavar), f"{flag}: metavar {a.metavar!r}"
    by_flag = {(name, a.option_strings[0]): a for name, a in option_actions()}
    for name in ("generate", "serve"):
        assert by_flag[name, "--dtype"].choices == ["auto", "float32", "float16", "bfloat16"]
        assert tuple(by_flag[name, "--kv-codec"].choices or ()) == CODEC_NAMES  # kvstore's codecs, all of them
    for name in ("generate", "serve", "cache-server"):
        assert tuple(by_flag[name, "--log-level"].choices or ()) == ("debug", "info", "warning", "error")


def test_max_tokens_help_states_the_sampling_params_default() -> None:
    _, subparsers = build_parser()
    action = subparsers["generate"]._option_string_actions["--max-tokens"]
    assert action.default == 64 and f"default to {SamplingParams().max_tokens}" in (action.help or "")


@pytest.mark.parametrize("value, ok", [("auto", True), ("cpu", True), ("cuda", True), ("cuda:3", True),
                                       ("tpu", False), ("cuda:", False), ("cuda:x", False), ("CPU", False)])
def test_device_prefix(value: str, ok: bool) -> None:
    if ok:
        assert device_arg(value) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="auto, cpu, cuda or cuda:N"):
            device_arg(value)


FAIL_FAST = """
import sys
from kvtier.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    print("exit", e.code, "torch" in sys.modules)
"""


@pytest.mark.parametrize("argv, bad", [
    (["generate", "--device", "tpu", "hi"], "argument --device: invalid device 'tpu'"),
    (["generate", "--dtype", "fp8", "hi"], "argument --dtype: invalid choice: 'fp8'"),
    (["serve", "--kv-codec", "zstd"], "argument --kv-codec: invalid choice: 'zstd'"),
    (["serve", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["cache-server", "--log-level", "verbose"], "argument --log-level: invalid choice: 'verbose'"),
])
def test_a_bad_choice_fails_fast_with_the_subcommand_usage(argv: list[str], bad: str) -> None:
    r = process.run([sys.executable, "-c", FAIL_FAST, *argv], cwd=REPO, capture_output=True, text=True,
                    timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.split() == ["exit", "2", "False"]  # rejected before torch was imported
    assert f"usage: kvtier {argv[0]}" in r.stderr and bad in r.stderr


def test_log_level_is_case_insensitive_and_configures_logging_once() -> None:
    _, subparsers = build_parser()
    assert subparsers["cache-server"].parse_args(["--log-level", "DEBUG"]).log_level == "debug"
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    try:
        configure_logging("error")
        configure_logging("debug")
        assert root.level == logging.DEBUG and len(root.handlers) == max(len(before), 1)
    finally:
        root.handlers[:] = before
        root.setLevel(level)


def test_unwritable_cache_server_disk_is_one_line_naming_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for entry in (["-m", "kvtier"], ["-m", "kvtier.cmd_cache_server"]):  # the CLI and the light entry point
        args = entry + (["cache-server"] if entry[-1] == "kvtier" else [])
        r = process.run([sys.executable, *args, "--port", "0", "--disk", str(blocker / "spill")], cwd=REPO,
                        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(err) == 1, r.stderr
        want = f"--disk {blocker / 'spill'}: not a writable directory (Not a directory)"
        assert err[0] == f"kvtier cache-server: error: {want}"
        assert r.stdout == ""


def test_the_cache_plan_help_imports_no_torch() -> None:
    """`kvtier cache plan --help` shows its defaults (the trace's block size among them, read
    from kvstore/traces.py) without loading torch."""
    r = process.run([sys.executable, "-c", FAIL_FAST, "cache", "plan", "--help"], cwd=REPO, capture_output=True,
                    text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.split()[-3:] == ["exit", "0", "False"], r.stdout + r.stderr
    assert "--block-tokens N" in r.stdout and "(default: 512)" in r.stdout
