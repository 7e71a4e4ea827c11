"""Keys have one home, kvkeys/ (docs/architecture.md, "Keys"), read from every shipped module's
source: nothing else derives a key from tokens, and a keyspace is built only there and by the
connector's one factory (`ConnectorConfig.keyspace`), whose result the connector's halves share."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_rules import REPO, shipped

CHAIN_PRIMITIVES = {"chain_hash", "chain_prefixes", "root_hash", "salted_root", "seal_root"}
ENGINE_CHAIN = {"engine/block_pool.py", "engine/block_manager.py"}  # the engine's own prefix-cache chain
KEYSPACE_BUILDERS = {"connector/connector_config.py"}  # ConnectorConfig.keyspace: the connector's factory


def _calls(path: Path) -> list[tuple[int, str]]:
    """Returns (line, name) of every call of a plain or dotted name in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            out.append((node.lineno, name))
    return out


def test_only_kvkeys_derives_keys_from_tokens() -> None:
    broken = [f"{rel}:{line} calls {name}" for rel, path in shipped() if not rel.startswith("kvkeys/")
              and rel not in ENGINE_CHAIN for line, name in _calls(path) if name in CHAIN_PRIMITIVES]
    assert not broken, "keys come from a Keyspace (kvkeys/):\n" + "\n".join(broken)


def test_a_keyspace_is_built_only_in_its_home_and_by_the_connectors_factory() -> None:
    broken = [f"{rel}:{line} builds a Keyspace" for rel, path in shipped() if not rel.startswith("kvkeys/")
              and rel not in KEYSPACE_BUILDERS for line, name in _calls(path) if name == "Keyspace"]
    assert not broken, "\n".join(broken)


def test_the_rules_see_what_they_forbid(tmp_path: Path) -> None:
    """The checks above find a call where one is (so their silence means something)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from kvkeys.chain import chain_hash\nks = Keyspace('m')\nchain_hash(b'', [1])\n")
    assert [name for _, name in _calls(probe)] == ["Keyspace", "chain_hash"]
    assert (REPO / "kvkeys" / "keyspace.py").exists()
