"""Each setting is declared once: its type, default, `KVTIER_*` variable, flag and help in one
dataclass field (`kvsettings.opt`), and every reader, table and parser takes them from there.

- No shipped module outside kvsettings/ names a `KVTIER_*` variable in code: a string that is a
  variable's name (or builds one, `f"KVTIER_{x}"`) appears only as the `env=`/`aliases=` of its
  declaration (`kvsettings.opt(...)` in a config field), so no variable is read by name, directly or
  through a constant, tuple or variable holding it. The variables are read through their
  declarations (`kvsettings.ProcessEnv`, the configs' fields and the rows `field_settings` makes of
  them, `kvsettings.variable`), in kvsettings/; prose (help, docstrings, errors) may name them.
- kvstore's table of keys is read from `KVStoreConfig`'s fields, not written beside them.
- The cache server's and the router's flags are built from `ServerConfig`/`StoreBudgets` and
  `RouterConfig`: no flag default is written in their command modules, and each parser's
  defaults are the dataclass fields' defaults.
- The connector's `--chunk-size` and CacheBlend's `--blend-ratio`/`--blend-check-layer` are
  `connector.cli_flags.FieldFlag`s of `ConnectorConfig`'s and `BlendConfig`'s fields (help, shown
  default and type from the field; None when not given); `kvtier cache plan --block-tokens`
  shows kvstore/trace_replay.py's `BLOCK_TOKENS`; `kvtier generate --top-p/--top-k` default to
  `SamplingParams`' fields. No help text of the connector's, CacheBlend's, `kvtier cache`'s,
  the cache server's or the router's flags writes a number as its default.
"""

from __future__ import annotations

import argparse
import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvsettings import (
    PROCESS_SETTINGS,
    TENANT_TAG_KEY,
    TIERS_ENV,
    ProcessEnv,
    Setting,
    field_default,
    field_settings,
    flag_of,
    variable,
)

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("kvstore", "connector", "kvtier", "engine", "kvkeys", "hostmem")
"""Where no `KVTIER_*` variable is named in code: the settings' home, kvsettings/, is not scanned."""
DECLARING = ("env", "aliases")
"""The keywords of `opt(...)` that declare a setting's variable (and its older names)."""
_NAME = re.compile(r"KVTIER_[A-Z0-9_]*")


def _modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (REPO / pkg).rglob("*.py"))


def _is_var(node: ast.AST) -> bool:
    """Whether `node` is a string that is a variable's name, or its start (`"KVTIER_" + key`, an f-string's)."""
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.fullmatch(node.value) is not None


def _declaration_sites(tree: ast.AST) -> set[int]:
    """Returns the ids of the strings that declare a variable: `opt(..., env="KVTIER_X", aliases=("KVTIER_Y",))`."""
    sites = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "opt":
            for kw in node.keywords:
                if kw.arg in DECLARING:
                    sites |= {id(n) for n in ast.walk(kw.value) if _is_var(n)}
    return sites


def named_variables(tree: ast.AST) -> list[int]:
    """Returns the lines that name a `KVTIER_*` variable in code outside its declaration: a read
    (`os.getenv("KVTIER_X")`, `env["KVTIER_X"]`, `"KVTIER_X" in env`), and the name kept in a
    constant, tuple or variable to read later (`VARS = ("KVTIER_X",)`, `env.get(VARS[0])`) or built
    (`f"KVTIER_{key}"`). Prose that names one (help, docstrings, errors) is not a name in code."""
    declared = _declaration_sites(tree)
    return sorted({n.lineno for n in ast.walk(tree) if _is_var(n) and id(n) not in declared})


def test_the_scan_sees_each_form_of_read() -> None:
    source = """
import os
a = os.environ.get("KVTIER_A")
b = os.getenv("KVTIER_B", "x")
c = env["KVTIER_C"]
d = "KVTIER_D" in os.environ
e = os.environ.get("HOME")
f = help_text("KVTIER_F is named, not read")
NAMES = (ProcessEnv.config, "KVTIER_G")
def first_set(env):
    return next((v for v in NAMES if env.get(v)), None)
TIERS = "KVTIER_H"
h = os.environ.get(TIERS)
i = os.environ.get(f"KVTIER_{key.upper()}")
j = os.environ.get("KVTIER_" + key.upper())
k: int = field(default=1, metadata=opt("a help naming KVTIER_K", env="KVTIER_K", parse=env_int))
m: str = field(default="", metadata=opt("old names", env="KVTIER_M", aliases=("KVTIER_OLD_M",), parse=env_str))
n = opt("a value that is no declaration", metavar="KVTIER_N")
"""
    assert named_variables(ast.parse(source)) == [3, 4, 5, 6, 9, 12, 14, 15, 18]


def test_no_module_names_a_kvtier_variable_outside_its_declaration() -> None:
    found = [f"{p.relative_to(REPO)}:{line}" for p in _modules(*SCANNED)
             for line in named_variables(ast.parse(p.read_text(encoding="utf-8")))]
    assert found == [], ("read these through their declaration (kvsettings.ProcessEnv.read(), the config field "
                         f"that declares the variable, kvsettings.variable), not by name: {found}")


def test_the_variables_that_enable_the_connector_are_their_declarations() -> None:
    from engine.kv_connector import CONNECTOR_ENV
    from kvstore.store_config import KVStoreConfig

    assert CONNECTOR_ENV == (variable(ProcessEnv, "config"), variable(KVStoreConfig, "tiers"), "LMCACHE_CONFIG_FILE")
    assert variable(KVStoreConfig, "tiers") is TIERS_ENV


def test_each_process_variable_is_declared_once() -> None:
    names = [s.env for s in PROCESS_SETTINGS]
    assert len(names) == len(set(names))
    assert {"KVTIER_API_KEY", "KVTIER_AUTH_TOKEN", "KVTIER_TENANT_TAG_KEY", "KVTIER_CONFIG",
            "KVTIER_HOME"} <= set(names)
    assert ProcessEnv.read({}) == ProcessEnv()
    env = {"KVTIER_API_KEY": "", "KVTIER_CONFIG": " ", "KVTIER_HOME": "/h", "KVTIER_TENANT_TAG_KEY": " k "}
    read = ProcessEnv.read(env)
    # a blank secret is kept for its reader to refuse; a blank path or tag key is unset
    assert (read.api_key, read.config, read.home, read.tenant_tag_key) == ("", None, "/h", "k")


def test_config_variables_are_declared_once() -> None:
    from connector.connector_config import CONNECTOR_SETTINGS
    from kvstore.store_config import KVSTORE_SETTINGS

    rows = [*KVSTORE_SETTINGS, *CONNECTOR_SETTINGS, *PROCESS_SETTINGS]
    seen: dict[str, Setting] = {}
    twice = set()
    for row in rows:
        for var in (row.env, *row.aliases):
            first = seen.setdefault(var, row)
            # a variable in two tables is allowed only as one declaration shown twice (the tenant
            # tag key: a connector key, and read by processes that run no connector): the same
            # text object, not a copy of it
            if first is not row and first.meaning is not row.meaning:
                twice.add(var)
    assert not twice, f"declared more than once: {sorted(twice)}"


def test_the_tenant_tag_key_is_one_declaration() -> None:
    from connector.connector_config import ConnectorConfig

    connector = next(f for f in fields(ConnectorConfig) if f.name == "tenant_tag_key").metadata
    process = next(f for f in fields(ProcessEnv) if f.name == "tenant_tag_key").metadata
    assert dict(process) == TENANT_TAG_KEY and process["help"] is TENANT_TAG_KEY["help"]
    assert {k: v for k, v in connector.items() if k != "check"} == TENANT_TAG_KEY
    assert connector["help"] is TENANT_TAG_KEY["help"]


def test_kvstore_table_is_read_from_the_fields() -> None:
    from kvstore.store_config import KVSTORE_SETTINGS, KVStoreConfig

    assert KVSTORE_SETTINGS == field_settings(KVStoreConfig)
    assert [s.key for s in KVSTORE_SETTINGS] == [f.name for f in fields(KVStoreConfig)]
    tree = ast.parse((REPO / "kvstore/store_config.py").read_text(encoding="utf-8"))
    rows = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == "Setting"]
    assert rows == [], f"kvstore/store_config.py writes Setting rows by hand (lines {rows}); declare them in the fields"
    defaults = {s.key: s.default for s in KVSTORE_SETTINGS}
    config = KVStoreConfig()
    for key in ("queue_size", "queue_full", "backoff_initial_s", "backoff_max_s", "breaker_failures",
                "flush_timeout_s"):
        assert defaults[key] == str(getattr(config, key))


def literal_defaults(path: Path) -> list[int]:
    """Returns the lines of `path` whose `add_argument(...)` writes a literal `default=`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            for kw in node.keywords:
                if kw.arg == "default" and not isinstance(kw.value, (ast.Name, ast.Attribute, ast.Call)):
                    lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", ["kvtier/cmd_cache_server.py", "kvtier/cmd_router.py"])
def test_no_flag_default_is_written_in_the_command(module: str) -> None:
    assert literal_defaults(REPO / module) == [], f"{module}: take the flag's default from its config field"


def _parser_defaults_match(add_arguments, *configs: type) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    flags = 0
    for config in configs:
        for f in fields(config):
            flag = flag_of(f)
            if flag is None:
                continue
            flags += 1
            assert flag in parser._option_string_actions, f"{config.__name__}.{f.name}: {flag} missing"
            assert getattr(args, f.name) == field_default(f), f"{flag}: the parser's default is not the field's"
    assert flags


def test_cache_server_flags_are_built_from_the_config() -> None:
    from kvstore.cache_server.server import ServerConfig, StoreBudgets
    from kvtier import cmd_cache_server

    _parser_defaults_match(cmd_cache_server.add_arguments, ServerConfig, StoreBudgets)
    # the values the CLI parses are the ones the config checks, once, naming the flag
    parser = argparse.ArgumentParser()
    cmd_cache_server.add_arguments(parser)
    args = parser.parse_args(["--max-payload", "1MiB", "--idle-timeout", "0"])
    values = {f.name: getattr(args, f.name) for f in fields(ServerConfig)}
    assert values["max_payload"] == 1 << 20
    with pytest.raises(ValueError, match="--idle-timeout must be positive, got 0.0"):
        ServerConfig(**values).validate()


def test_router_flags_are_built_from_the_config() -> None:
    from kvtier import cmd_router
    from kvtier.router.policy import KvAware
    from kvtier.router.router_config import RouterConfig

    _parser_defaults_match(cmd_router.add_arguments, RouterConfig)
    assert KvAware.__init__.__defaults__ == (RouterConfig.lookup_timeout, RouterConfig.balance_threshold)


def test_engine_flags_are_built_from_the_config() -> None:
    from engine.engine_config import EngineConfig
    from kvtier.engine_args import add_engine_arguments

    _parser_defaults_match(add_engine_arguments, EngineConfig)


WRITTEN_DEFAULT = re.compile(r"\(default:? -?[0-9]|default:? -?[0-9.]+[;,)]")
"""A help text that writes a number as its default ("(default 256)", "(default: 0.15; ..."),
beside the field or constant that holds it."""


def help_defaults(path: Path) -> list[int]:
    """Returns the lines of `path` whose `add_argument(...)` help writes a number as the default."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            texts = [n.value for kw in node.keywords if kw.arg == "help" for n in ast.walk(kw.value)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            if any(WRITTEN_DEFAULT.search(t) for t in texts):
                lines.append(node.lineno)
    return lines


def test_the_help_scan_sees_a_written_default(tmp_path: Path) -> None:
    sample = tmp_path / "flags.py"
    sample.write_text('p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default 256)")\n'
                      'p.add_argument("--ratio", help="fraction recomputed (default 0.15; 0 = plain reuse)")\n'
                      'p.add_argument("--n", help="most tokens " "(default: 64)")\n'
                      'p.add_argument("--seed", help="sampling seed (default: none, not reproducible)")\n'
                      'p.add_argument("--top-k", default=K, help="keep the N most likely; -1 = all")\n')
    assert help_defaults(sample) == [1, 2, 3]


@pytest.mark.parametrize("module", ["connector/cli_flags.py", "connector/blend/plugin.py", "kvtier/cmd_cache.py",
                                    "kvtier/cmd_cache_server.py", "kvtier/cmd_router.py"])
def test_no_flag_help_writes_its_default(module: str) -> None:
    assert help_defaults(REPO / module) == [], f"{module}: show the default of the field or constant that holds it"


def test_connector_flags_are_built_from_the_config() -> None:
    """`--chunk-size`, `--blend-ratio` and `--blend-check-layer` set their key only when given
    (None otherwise: the config file, the environment or the field's default applies); their
    help, shown default and type are their fields'."""
    from connector.blend.blend_config import BlendConfig
    from connector.blend.plugin import KNOB_FLAGS, SECTION, knob_flag
    from connector.cli_flags import FieldFlag, add_connector_arguments, config_field
    from connector.connector_config import ConnectorConfig
    from kvtier.cli_help import help_with_default

    chunk = config_field(ConnectorConfig, "chunk_size")
    rows = [(flag_of(chunk), "chunk_size", chunk)]
    rows += [(knob_flag(name), f"{SECTION}_{name}", config_field(BlendConfig, name)) for name in KNOB_FLAGS]
    assert [r[0] for r in rows] == ["--chunk-size", "--blend-ratio", "--blend-check-layer"]
    parser = argparse.ArgumentParser()
    add_connector_arguments(parser)
    unset = parser.parse_args([])
    for flag, dest, f in rows:
        action = parser._option_string_actions[flag]
        assert isinstance(action, FieldFlag) and action.dest == dest
        default = field_default(f)
        shown = f"{f.metadata['help']} (default: {default})"
        assert help_with_default(action) % vars(action) == shown  # as the field says, once
        assert getattr(unset, dest) is None
        given = getattr(parser.parse_args([flag, str(default)]), dest)
        assert given == default and type(given) is type(default)
    with pytest.raises(SystemExit):
        parser.parse_args(["--chunk-size", "x"])


def test_cache_plan_block_tokens_is_the_trace_constant() -> None:
    from kvstore.traces import BLOCK_TOKENS
    from kvtier import cmd_cache

    parser = argparse.ArgumentParser()
    cmd_cache.add_arguments(parser)
    plan = parser.parse_args(["plan", "--trace", "t.jsonl", "--tier", "cpu"])
    assert plan.block_tokens is None  # not given: kvstore/trace_replay.py's BLOCK_TOKENS
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["plan"]
    action = sub._option_string_actions["--block-tokens"]
    assert (action.help % vars(action)).endswith(f"(default: {BLOCK_TOKENS})")
    assert parser.parse_args(["plan", "--trace", "t", "--tier", "cpu", "--block-tokens", "16"]).block_tokens == 16


def test_generate_sampling_flags_default_to_sampling_params() -> None:
    from engine.sampling_params import SamplingParams
    from kvtier import cmd_generate

    parser = argparse.ArgumentParser()
    cmd_generate.add_arguments(parser)
    args = parser.parse_args(["hi"])
    assert (args.top_p, args.top_k) == (SamplingParams().top_p, SamplingParams().top_k)
