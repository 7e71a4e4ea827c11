"""The `kvtier` command itself: help without a subcommand, --version, typo'd flags."""

from __future__ import annotations

import pytest

from kvtier import __version__
from kvtier.cli import main


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
