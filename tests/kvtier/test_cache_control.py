"""Operating the cache of a real `kvtier serve` (issue #50, item 1: inspect, pin, unpin,
prefetch, move, drop, clear) over a small cpu tier and a small disk tier, chunks of 32 tokens: inspect shows which
tier holds each chunk of a prompt; a pinned prefix survives a flood that evicts everything
else, and is evicted once unpinned; a pin past the pin budget is refused whole; a pin's ttl
expires; prefetch makes the next request load from the faster tier, and computes what no tier
holds; move and drop; clear by tenant leaves the other tenant; a tenant's key cannot pin or clear; the
`kvtier cache` command line prints what the route answers; a budget lowered at run time
(`/kv/budget`, `kvtier cache budget`) is met at once and never passed after.

Prompts are token ids (exact chunk counts): a 64-token prompt is two full chunks."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harness import process
from harness.polling import wait_until
from harness.serve import NAME, REPO, ServeProcess
from kvtier.cli import main as cli_main
from kvtier.cmd_cache import NOTHING_MATCHED

pytestmark = pytest.mark.slow
ADMIN, TENANT = "sk-operator", "sk-tenant-t"
CHUNK_TOKENS = 32
# 30 layers x K,V x 32 tokens x 3 KV heads x 64 x float32
CHUNK_BYTES = 30 * 2 * CHUNK_TOKENS * 3 * 64 * 4
CPU, DISK = "cpu", "disk"  # tiers by kind; the server names them "0:cpu", "1:disk:///..."


def kind(name: str) -> str:
    return name.split(":")[1]


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """cpu: room for 4 chunks, pins for 2; disk: room for 5 chunks, pins for 2."""
    tmp = tmp_path_factory.mktemp("cache-control")
    (tmp / "tenants.json").write_text(json.dumps({TENANT: "salt-t"}))
    pins = 2 * CHUNK_BYTES + 4096
    proc = ServeProcess("--model", str(default_model_path), "--device", "cpu", "--dtype", "float32",
                        "--num-gpu-blocks", "64", "--max-num-seqs", "2", "--chunk-size", str(CHUNK_TOKENS),
                        "--kv-tier", f"cpu?budget={4 * CHUNK_BYTES + 4096}&pin_budget={pins}",
                        "--kv-tier", f"disk://{tmp / 'disk'}?budget={5 * CHUNK_BYTES + 16384}&pin_budget={pins}",
                        "--api-key", ADMIN, "--tenants", str(tmp / "tenants.json"))
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


_rng = random.Random(50)


def prompt(n: int = 64) -> list[int]:
    """A fresh prompt of `n` token ids (no prefix shared with any other)."""
    return [_rng.randrange(1000, 40000) for _ in range(n)]


def run(server: ServeProcess, ids: list[int], salt: str | None = None) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=ADMIN, max_retries=0, timeout=120)
    client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0,
                              extra_body={"cache_salt": salt} if salt else None)


def post(server: ServeProcess, route: str, body: dict[str, Any], key: str = ADMIN) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def inspect(server: ServeProcess, ids: list[int], salt: str | None = None, key: str = ADMIN) -> dict[str, Any]:
    """Returns /kv/inspect's answer with tiers named by kind."""
    r = post(server, "/kv/inspect", {"prompt_token_ids": ids} | ({"cache_salt": salt} if salt else {}), key)
    assert r.status_code == 200, r.text
    seen = r.json()
    for ch in seen["chunks"]:
        ch["tiers"] = {kind(n): v for n, v in ch["tiers"].items()}
    seen["tiers"] = {kind(n): v for n, v in seen["tiers"].items()}
    return seen


def holders(server: ServeProcess, ids: list[int], salt: str | None = None) -> list[set[str]]:
    """Per chunk of the prompt, the tiers holding it."""
    return [set(c["tiers"]) for c in inspect(server, ids, salt)["chunks"]]


def stored(server: ServeProcess, ids: list[int], tiers: set[str], salt: str | None = None) -> None:
    """Waits until every chunk of `ids` is in `tiers` (the disk's writes are in the background)."""
    assert wait_until(lambda: all(h >= tiers for h in holders(server, ids, salt)), 30), holders(server, ids, salt)


def pin(server: ServeProcess, ids: list[int], tier: str, **kw: Any) -> httpx.Response:
    return post(server, "/kv/pin", {"prompt_token_ids": ids, "tier": tier} | kw)


def test_inspect_pin_flood_unpin(server: ServeProcess) -> None:
    a, c = prompt(64), prompt(32)
    run(server, a)
    run(server, c)
    stored(server, a, {CPU, DISK})
    stored(server, c, {CPU, DISK})
    seen = inspect(server, a)
    assert [(ch["start"], ch["end"]) for ch in seen["chunks"]] == [(0, 32), (32, 64)]
    for ch in seen["chunks"]:
        cpu, disk = ch["tiers"][CPU], ch["tiers"][DISK]
        assert cpu["bytes"] == CHUNK_BYTES and disk["bytes"] > CHUNK_BYTES  # the file has headers
        assert cpu["age_s"] >= 0 and cpu["idle_s"] >= 0 and disk["idle_s"] >= 0 and not cpu["pinned"]
    tiers = seen["tiers"]
    assert tiers[CPU]["entries"] == 3 and tiers[CPU]["bytes"] == 3 * CHUNK_BYTES and tiers[CPU]["can_pin"]
    (family, counts), = tiers[CPU]["by_model"].items()  # one model, dtype, layout and chunk size
    assert ":float32:v" in family and family.endswith(f":c{CHUNK_TOKENS}"), family
    assert counts == {"entries": 3, "bytes": 3 * CHUNK_BYTES}
    assert tiers[DISK]["by_model"][family]["entries"] == 3

    # a pin with a ttl, then one that does not fit beside it: refused whole
    r = pin(server, c, "cpu", ttl_s=1.5)
    assert r.status_code == 200 and r.json()["chunks"] == 1 and r.json()["pinned_bytes"] == CHUNK_BYTES, r.text
    r = pin(server, a, "cpu")
    assert r.status_code == 409 and "pin budget" in r.json()["error"]["message"], r.text
    assert not any(ch["tiers"][CPU]["pinned"] for ch in inspect(server, a)["chunks"])
    assert inspect(server, c)["chunks"][0]["tiers"][CPU]["pin_expires_in_s"] <= 1.5
    assert wait_until(lambda: inspect(server, c)["tiers"][CPU]["pinned_entries"] == 0, 5)  # expired
    expired = inspect(server, c)
    assert expired["tiers"][CPU]["pinned_bytes"] == 0 and not expired["chunks"][0]["tiers"][CPU]["pinned"]

    # pinned in both tiers, a survives a flood that evicts everything else
    for tier in ("0:cpu", "disk"):
        r = pin(server, a, tier)
        assert r.status_code == 200 and r.json()["chunks"] == 2, r.text
    flood = [prompt(64) for _ in range(3)]
    for ids in flood:
        run(server, ids)
    stored(server, flood[-1], {CPU, DISK})
    assert holders(server, a) == [{CPU, DISK}] * 2
    assert all(ch["tiers"][t]["pinned"] for ch in inspect(server, a)["chunks"] for t in (CPU, DISK))
    assert holders(server, c) == [set()] and holders(server, flood[0]) == [set(), set()]
    after = inspect(server, a)["tiers"]
    assert after[CPU]["pinned_bytes"] == 2 * CHUNK_BYTES and after[CPU]["entries"] == 4

    # unpinned, the next flood evicts it
    for tier in ("cpu", "disk"):
        r = post(server, "/kv/unpin", {"prompt_token_ids": a, "tier": tier})
        assert r.status_code == 200 and r.json()["released"] == 2 and r.json()["pinned_entries"] == 0, r.text
    flood = [prompt(64) for _ in range(3)]
    for ids in flood:
        run(server, ids)
    stored(server, flood[-1], {CPU, DISK})
    assert holders(server, a) == [set(), set()]


def test_clear_by_tenant_and_who_may(server: ServeProcess) -> None:
    ids = prompt(32)
    for salt in ("salt-t", "salt-u"):
        run(server, ids, salt)
    stored(server, ids, {CPU}, "salt-t")
    stored(server, ids, {CPU}, "salt-u")
    # a tenant's key: its own salt's chunks and only its own tenant's usage; no pins, no clears
    mine = inspect(server, ids, key=TENANT)
    assert set(mine["chunks"][0]["tiers"]) >= {CPU} and len(mine["tiers"][CPU]["by_tenant"]) == 1
    assert mine["tiers"][CPU]["by_model"] is None  # every tenant's: the operator's to see
    assert len(inspect(server, ids, "salt-u")["tiers"][CPU]["by_tenant"]) >= 2  # the operator sees every tenant
    for route, body in (("/kv/pin", {"prompt_token_ids": ids}), ("/kv/unpin", {"prompt_token_ids": ids}),
                        ("/kv/clear", {"cache_salt": "salt-t"}), ("/kv/clear", {"all": True})):
        assert post(server, route, body, key=TENANT).status_code == 403, route
    assert post(server, "/kv/clear", {"cache_salt": "salt-t", "all": True}).status_code == 400

    r = post(server, "/kv/clear", {"cache_salt": "salt-t"})
    assert r.status_code == 200 and r.json()["tiers"]["0:cpu"] >= 1 and not r.json()["errors"], r.text
    assert holders(server, ids, "salt-t") == [set()]
    assert CPU in holders(server, ids, "salt-u")[0]


def test_the_command_line_and_clear_all(server: ServeProcess) -> None:
    ids = prompt(32)
    run(server, ids)
    stored(server, ids, {CPU, DISK})
    cmd = [sys.executable, "-m", "kvtier", "cache", "inspect", "--url", server.url, "--api-key", ADMIN,
           "--token-ids", ",".join(map(str, ids))]
    r = process.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert {kind(n) for n in json.loads(r.stdout)["chunks"][0]["tiers"]} == {CPU, DISK}

    r1 = post(server, "/kv/clear", {"older_than_s": 3600})  # nothing is that old
    assert r1.status_code == 200 and r1.json()["tiers"]["0:cpu"] == 0 and not r1.json()["errors"], r1.text
    assert holders(server, ids) == [{CPU, DISK}]
    r2 = post(server, "/kv/clear", {"all": True})
    assert r2.status_code == 200 and r2.json()["tiers"]["0:cpu"] >= 1 and r2.json()["engine_reset"], r2.text
    assert holders(server, ids) == [set()]


def test_clear_by_the_served_name_and_a_model_not_stored(server: ServeProcess) -> None:
    """The served name clears the served model's chunks; a model nothing is stored of is an
    error naming what is stored (the CLI exits non-zero), and removes nothing."""
    ids = prompt(48)
    run(server, ids)
    stored(server, ids, {CPU, DISK})
    cmd = [sys.executable, "-m", "kvtier", "cache", "clear", "--url", server.url, "--api-key", ADMIN,
           "--stored-model", "no-such-model"]
    r = process.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no tier holds chunks of model 'no-such-model'" in r.stderr, r.stderr
    before = holders(server, ids)
    assert before and all(h == {CPU, DISK} for h in before)  # nothing removed
    cleared = post(server, "/kv/clear", {"stored_model": NAME})
    assert cleared.status_code == 200 and cleared.json()["tiers"]["0:cpu"] >= len(before), cleared.text
    assert holders(server, ids) == [set()] * len(before)


def tier_hits(server: ServeProcess) -> dict[str, float]:
    """Returns per tier kind the tokens requests loaded from it (`/metrics`)."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvtier:kv_tier_hit_tokens_total{"):
            name = line.split('tier="', 1)[1].split('"', 1)[0]
            out[kind(name)] = float(line.rsplit(" ", 1)[1])
    return out


def test_prefetch_move_drop(server: ServeProcess, capsys: pytest.CaptureFixture[str]) -> None:
    a = prompt(64)
    run(server, a)
    stored(server, a, {CPU, DISK})
    r = post(server, "/kv/drop", {"prompt_token_ids": a, "tier": "cpu"})
    assert r.status_code == 200 and r.json()["removed"] == 2, r.text
    assert holders(server, a) == [{DISK}] * 2

    # prefetch copies the disk's chunks into cpu, and the next request loads them from cpu
    r = post(server, "/kv/prefetch", {"prompt_token_ids": a, "tier": "cpu"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [kind(n) for n in got["copied"]] == [DISK] and sum(got["copied"].values()) == 2, got
    assert got["held_before"] == 0 and got["held_tokens"] == 64 and got["ran_request"] is None, got
    assert holders(server, a) == [{CPU, DISK}] * 2
    before = tier_hits(server)
    assert post(server, "/kv/reset_prefix_cache", {}).json() == {"reset": True}
    run(server, a)
    after = tier_hits(server)
    assert after[CPU] - before.get(CPU, 0) >= 32 and after.get(DISK, 0) == before.get(DISK, 0), (before, after)

    # move: a chunk the target holds is only removed from the source; else copied, then removed
    r = post(server, "/kv/move", {"prompt_token_ids": a, "from_tier": "cpu", "to_tier": "disk"})
    assert r.status_code == 200 and r.json()["moved"] == 2 and r.json()["refused"] == 0, r.text
    assert holders(server, a) == [{DISK}] * 2
    r = post(server, "/kv/move", {"prompt_token_ids": a, "from_tier": "disk", "to_tier": "cpu"})
    assert r.status_code == 200 and r.json()["moved"] == 2, r.text
    assert holders(server, a) == [{CPU}] * 2 and r.json()["held_tokens"] == {"0:cpu": 64, r.json()["from"]: 0}
    for body in ({"from_tier": "cpu", "to_tier": "cpu"}, {"from_tier": "cpu", "to_tier": "tape"}):
        r = post(server, "/kv/move", {"prompt_token_ids": a} | body)
        assert r.status_code == 400 and "tier" in r.json()["error"]["message"], r.text

    # compute: a prompt no tier holds is run, stored, and lands in the asked tier
    b = prompt(64)
    r = post(server, "/kv/prefetch", {"prompt_token_ids": b, "tier": "disk", "compute": True})
    assert r.status_code == 200, r.text
    assert r.json()["ran_request"] == {"prompt_tokens": 64, "cached_tokens": 0} and r.json()["held_tokens"] == 64
    assert holders(server, b) == [{CPU, DISK}] * 2

    for route in ("/kv/prefetch", "/kv/move", "/kv/drop"):
        body = {"prompt_token_ids": b, "from_tier": "cpu", "to_tier": "disk"}
        assert post(server, route, body, key=TENANT).status_code == 403, route
    cmd = [sys.executable, "-m", "kvtier", "cache", "drop", "--url", server.url, "--api-key", ADMIN,
           "--tier", "disk", "--token-ids", ",".join(map(str, b))]
    r2 = process.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r2.returncode == 0 and json.loads(r2.stdout)["removed"] == 2, r2.stderr
    assert holders(server, b) == [{CPU}] * 2
    # the same drop again matches nothing: it says so and exits 3, not 0 (the command line, in process)
    assert cli_main(cmd[3:]) == NOTHING_MATCHED
    assert "nothing matched" in capsys.readouterr().err


def test_a_budget_lowered_at_run_time_is_met_at_once(server: ServeProcess) -> None:
    """`/kv/budget` lowers the cpu tier's budget: met before it answers (the oldest unpinned
    chunk evicted, the pinned one kept), never passed by the stores after; refused whole below
    what is pinned; the operator's alone. `kvtier cache budget` puts it back."""
    assert post(server, "/kv/clear", {"all": True}).status_code == 200
    first = [prompt(32) for _ in range(3)]
    for ids in first:
        run(server, ids)
        stored(server, ids, {CPU})
    assert pin(server, first[0], "cpu").status_code == 200
    budget = 2 * CHUNK_BYTES + 4096
    assert post(server, "/kv/budget", {"tier": "cpu", "budget": budget}, key=TENANT).status_code == 403
    r = post(server, "/kv/budget", {"tier": "cpu", "budget": budget})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tier"] == "0:cpu" and got["byte_budget"] == budget and got["entries"] == 2
    assert got["bytes"] == 2 * CHUNK_BYTES and got["pinned_bytes"] == CHUNK_BYTES
    assert [CPU in holders(server, ids)[0] for ids in first] == [True, False, True]
    later = prompt(32)  # stored within the new budget: first[2] makes room
    run(server, later)
    stored(server, later, {CPU})
    cpu = inspect(server, later)["tiers"][CPU]
    assert cpu["bytes"] == 2 * CHUNK_BYTES and cpu["byte_budget"] == budget
    assert [CPU in holders(server, ids)[0] for ids in first] == [True, False, False]

    for body, status in (({"budget": CHUNK_BYTES - 1}, 409), ({"budget": "lots"}, 400), ({}, 400)):
        r = post(server, "/kv/budget", {"tier": "cpu"} | body)
        assert r.status_code == status, r.text
    assert "cannot be evicted" in post(server, "/kv/budget", {"budget": 1}).json()["error"]["message"]
    assert inspect(server, first[0])["tiers"][CPU]["byte_budget"] == budget

    restored = 4 * CHUNK_BYTES + 4096
    assert restored % 1024 == 0
    cmd = [sys.executable, "-m", "kvtier", "cache", "budget", "--url", server.url, "--api-key", ADMIN,
           "--tier", "cpu", "--budget", f"{restored // 1024}KiB"]
    r2 = process.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["byte_budget"] == restored
    assert post(server, "/kv/unpin", {"prompt_token_ids": first[0], "tier": "cpu"}).json()["released"] == 1
