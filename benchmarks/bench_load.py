"""Load speed of every tier against this machine's physical floor, measured in one run (#31).

A load is what a warm request waits for: the connector's loader (connector/loader.py, the real
one) fetches a prefix's stored chunks from one tier and scatters them into fresh blocks of an
engine-shaped paged cache (the bundled model's geometry, fp32: 30 layers x 3 KV heads x 64).
Each load is timed from submit to its end and checked (the blocks hold the stored K/V). Next
to it, the floor of the same bytes on this machine, in the same invocation:

- `cpu`: a memcpy of the prefix's K/V (torch `copy_`, this process's threads);
- `disk`: plain `readinto` of the same files, each into its own page-aligned place in one
  preallocated buffer of their total size (a load too must land every byte in memory of its
  own), page cache warm, and cold (`posix_fadvise(DONTNEED)` on the files before each read, for the load
  too). The JSON also keeps `floor_reused_s`: every file into one file-sized buffer, which
  stays in the CPU's cache and so measures the cache, not a load's copy into memory (the floor
  of earlier runs, about 2x faster);
- `redis`, `kvtier` (the cache server): a raw client fetch of the same values over loopback
  (Redis: pipelined GETs on a plain socket into one preallocated buffer; the cache server:
  its own client's `get_many`), i.e. the transport.

Arms: raw and lz4 codecs, with and without an integrity key, at 1k, 4k and 16k tokens; the
growth of load time with length (least squares: seconds = a + b * tokens). `--ttft` adds the
warm TTFT of a 2k-token prompt from the cpu tier against a one-token forward (the engine's
prefix-cache hit of the same prompt) plus the memcpy floor of its K/V (target <= 2x).
`--profile` prints where one 4k load's time goes per tier (cProfile, by own time).

    .venv/bin/python -m benchmarks.bench_load [--quick] [--tiers cpu,disk,redis,kvtier]
        [--tokens 1024,4096,16384] [--ttft] [--profile]

Writes benchmarks/results/load.{json,md} (not with --quick, whose figures mean little).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import blake3
import cramjam
import torch

from benchmarks.bench_store import timed, timed_together
from connector.connector_config import make_config
from connector.connector_metrics import ConnectorMetrics
from connector.loader import Loader
from connector.metadata import LoadSpec
from connector.store_queue import StoreQueue
from connector.vllm.layouts import vllm_layout_for
from engine.kv_cache import EngineLayout, PagedKVLayout, zeroed_pool
from engine.model_config import ModelConfig
from kvkeys.keyspace import Keyspace, Span
from kvstore import serde
from kvstore.backends.disk.file_names import key_path
from kvstore.read_buffers import PAGE, page_aligned
from kvstore.storage_manager import StorageManager

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
CHUNK = 256
BLOCK = 16
SECRET = "bench-load-integrity-secret-0123456789"


def make_layout(name: str, mc: ModelConfig, num_blocks: int) -> PagedKVLayout:
    """Paged caches as kvtier's engine allocates them (engine/model_runner.py), or as vLLM's
    CPU backend does (`(num_blocks, H, block_size, 2 * D)` per layer, connector/vllm/layouts.py)."""
    if name == "engine":  # the engine's own allocation (huge pages where the host gives them)
        shape: tuple[int, ...] = (mc.num_layers, 2, num_blocks, BLOCK, mc.num_kv_heads, mc.head_size)
        return EngineLayout(list(zeroed_pool(shape, torch.float32, torch.device("cpu")).unbind(0)))
    shape = (num_blocks, mc.num_kv_heads, BLOCK, 2 * mc.head_size)
    return vllm_layout_for([torch.zeros(shape) for _ in range(mc.num_layers)], "cpu")


@dataclass
class Bench:
    """One tier's loader over an engine-shaped cache whose first half holds the stored prefix."""

    storage: StorageManager
    loader: Loader
    layout: PagedKVLayout
    keyspace: Keyspace
    blocks_per_half: int
    codec: str
    n_loads: int = 0

    def store(self, ids: list[int]) -> list[Span]:
        """Fills the source blocks with random K/V, stores the prefix's chunks in the tier (and
        waits until written); returns its spans."""
        spans = self.keyspace.spans(ids)
        for kv in self.layout.kv_caches:
            kv.normal_()
        src = list(range(self.blocks_per_half))
        items = [(sp.key, self.layout.gather_chunk(self.layout.slots(src, sp.start, sp.end))) for sp in spans]
        self.storage.batched_put(items, owned=True)
        if not self.storage.flush(timeout=600):
            raise RuntimeError("the tier did not finish writing the prefix")
        return spans

    def stored_values(self, spans: list[Span]) -> list[tuple[str, bytes]]:
        """Returns each span's key with the value the tier holds for it (serde's encoding is
        deterministic: encoding the same chunk again gives the stored bytes)."""
        src = list(range(self.blocks_per_half))
        return [(sp.key, bytes(serde.encode(sp.key, self.layout.gather_chunk(self.layout.slots(src, sp.start, sp.end)),
                                            self.codec))) for sp in spans]

    def load(self, spans: list[Span], n: int) -> None:
        """Loads positions [0, n) into the second half's blocks through the real loader."""
        self.n_loads += 1
        dst = list(range(self.blocks_per_half, 2 * self.blocks_per_half))
        job = self.loader.submit(LoadSpec(f"load-{self.n_loads}", 0, n, spans, [dst]))
        self.loader.wait_ended(job)
        if job.filled != n:
            raise RuntimeError(f"load {self.n_loads} ended at {job.filled} of {n} tokens")

    def check(self, n: int) -> None:
        """Raises unless the destination blocks hold what the source blocks hold."""
        src = self.layout.slots(list(range(self.blocks_per_half)), 0, n)
        dst = self.layout.slots(list(range(self.blocks_per_half, 2 * self.blocks_per_half)), 0, n)
        if not torch.equal(self.layout.gather_chunk(src), self.layout.gather_chunk(dst)):
            raise RuntimeError("a load wrote other K/V than was stored")


@contextmanager
def tier_bench(url: str, codec: str, integrity: bool, mc: ModelConfig, max_tokens: int,
               layout_name: str = "engine") -> Iterator[Bench]:
    config = make_config([url], chunk_size=CHUNK, codec=codec)
    config.kvstore.integrity_key = SECRET if integrity else None
    storage = StorageManager.from_config(config.kvstore)
    try:
        blocks = -(-max_tokens // BLOCK)
        layout = make_layout(layout_name, mc, 2 * blocks)
        keyspace = Keyspace(mc.fingerprint, layout.dtype, CHUNK, mc.num_layers)
        stores = StoreQueue(storage, config.store_queue_size, config.max_pending_store_bytes)
        loader = Loader(storage, stores, layout, keyspace, ConnectorMetrics())
        yield Bench(storage, loader, layout, keyspace, blocks, codec)
        loader.writer.close()
    finally:
        storage.close()


# ---- floors ------------------------------------------------------------------------------
def memcpy(nbytes: int) -> Callable[[], object]:
    """Returns a copy of `nbytes` between two buffers of their own: the cpu tier's floor."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    return lambda: dst.copy_(src)


def mac_seconds(values: list[tuple[str, bytes]], reps: int) -> float:
    """The MAC's own floor: keyed BLAKE3 over every stored value, one core (a load checks each
    value on the thread that reads it)."""
    key = bytes(32)
    return timed(lambda: [blake3.blake3(v, key=key).digest() for _, v in values], reps)


def lz4_seconds(values: list[tuple[str, bytes]], reps: int) -> float:
    """The LZ4 codec's decompression floor: every payload decompressed into one reused buffer,
    one core (cramjam, the codec's library)."""
    payloads = [memoryview(v)[serde.read_header(v).header_len:] for _, v in values]
    out = bytearray(max(int.from_bytes(p[:4], "little") for p in payloads))
    return timed(lambda: [cramjam.lz4.decompress_block_into(p, out) for p in payloads], reps)


def drop_page_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def file_buffer(paths: list[Path]) -> memoryview:
    """Returns a page-aligned buffer with a page-aligned place for every file of `paths`."""
    size = sum(-(-p.stat().st_size // PAGE) * PAGE for p in paths)
    return page_aligned(bytearray(size + PAGE), size).data


def read_files(paths: list[Path], buf: memoryview, reuse: bool = False) -> int:
    """Reads every file of `paths` into `buf`, each at its own page boundary (`reuse`: each at
    its start). Page-aligned, as the disk tier reads: into memory 16 bytes past a page boundary
    (where a bytearray's data starts) the same reads ran at half the speed here."""
    n = 0
    at = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            start = 0 if reuse else at
            n += f.readinto(buf[start:start + size])
            at += -(-size // PAGE) * PAGE
    return n


def redis_raw_fetch(host: str, port: int, keys: list[str]) -> Callable[[], int]:
    """Returns a fetch of `keys` from Redis at the transport's floor: pipelined GETs on a plain
    socket, every reply received into one preallocated buffer, nothing parsed but its length."""
    import redis

    sizes = [len(v) for v in redis.Redis(host=host, port=port).mget(keys) if v is not None]
    if len(sizes) != len(keys):
        raise RuntimeError("a stored value is missing from Redis")
    expected = sum(len(b"$%d\r\n" % n) + n + 2 for n in sizes)  # each bulk reply as sent
    commands = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k.encode()) for k in keys)
    sock = socket.create_connection((host, port))
    view = memoryview(bytearray(expected))

    def fetch() -> int:
        sock.sendall(commands)
        got = 0
        while got < expected:
            n = sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("Redis closed the connection mid-reply")
            got += n
        return sum(sizes)
    return fetch


def transport_fetch(url: str, keys: list[str]) -> Callable[[], int]:
    """Returns a raw fetch of `keys` from the Redis or cache server at `url` (bytes fetched)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme == "redis":
        return redis_raw_fetch(parts.hostname or "127.0.0.1", parts.port or 6379, keys)
    from kvstore.backends.server_client import CacheServerClient

    cs = CacheServerClient(parts.hostname or "127.0.0.1", parts.port or 0)
    raw = [k.encode() for k in keys]

    def cache_server_fetch() -> int:
        return sum(len(v) for v in cs.get_many(raw) if v is not None)
    return cache_server_fetch


# ---- arms --------------------------------------------------------------------------------
def measure_tier(name: str, url: str, mc: ModelConfig, tokens: list[int], codecs: list[str], reps: int,
                 disk_root: Path | None, layout_name: str = "engine") -> list[dict]:
    rows = []
    for codec in codecs:
        for integrity in (False, True):
            if name == "cpu" and codec == "raw" and integrity:
                continue  # the cpu tier keeps raw chunks as tensors: no value, no MAC
            with tier_bench(url, codec, integrity, mc, max(tokens), layout_name) as b:
                for n in tokens:
                    row = {"tier": name, "layout": layout_name, "codec": codec, "integrity": integrity,
                           "tokens": n, **measure_length(name, url, b, n, reps, disk_root)}
                    rows.append(row)
                    print(summary(row), flush=True)
    return rows


def measure_length(name: str, url: str, b: Bench, n: int, reps: int, disk_root: Path | None) -> dict:
    """Stores an n-token prefix in the tier; returns its load and floor seconds (and bytes)."""
    b.storage.clear()
    spans = b.store(list(range(1, n + 1)))
    kv_bytes = n * b.layout.bytes_per_token()
    reps = max(reps, reps * 4096 // n)  # short loads vary most: more of them, the minimum steadier
    row: dict = {"kv_bytes": kv_bytes, "reps": reps}
    if b.codec == "lz4" or serde.integrity_enabled():
        values = b.stored_values(spans)
        if serde.integrity_enabled():
            row["mac_s"] = mac_seconds(values, reps)
        if b.codec == "lz4":
            row["lz4_s"] = lz4_seconds(values, reps)

    def load() -> None:
        b.load(spans, n)
    if name == "disk":
        assert disk_root is not None
        paths = [key_path(disk_root, sp.key) for sp in spans]
        row["stored_bytes"] = sum(p.stat().st_size for p in paths)
        buf = file_buffer(paths)
        row["load_s"], row["floor_s"], row["floor_reused_s"] = timed_together(
            [load, lambda: read_files(paths, buf), lambda: read_files(paths, buf, reuse=True)], reps)
        row["load_cold_s"], row["floor_cold_s"] = timed_together(
            [load, lambda: read_files(paths, buf)], reps, lambda: drop_page_cache(paths))
    elif name == "cpu":
        row["load_s"], row["floor_s"] = timed_together([load, memcpy(kv_bytes)], reps)
    else:
        fetch = transport_fetch(url, [sp.key for sp in spans])
        row["stored_bytes"] = fetch()
        row["load_s"], row["floor_s"] = timed_together([load, fetch], reps)
    b.check(n)
    return row


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def work_floor_s(row: dict) -> float:
    """The floor plus the MAC's and the codec's own floors: the work of one core that reads,
    checks and decodes the same values, each part at its best."""
    return row["floor_s"] + row.get("mac_s", 0.0) + row.get("lz4_s", 0.0)


def summary(row: dict) -> str:
    floor_bytes = row.get("stored_bytes", row["kv_bytes"])
    mac = "on " if row["integrity"] else "off"
    s = (f"{row['tier']:7s} {row['layout']:8s} {row['codec']:4s} mac={mac} {row['tokens']:6d} tok: "
         f"load {gbps(row['kv_bytes'], row['load_s']):5.2f} GB/s, floor {gbps(floor_bytes, row['floor_s']):5.2f} "
         f"GB/s, {row['floor_s'] / row['load_s']:4.0%}")
    if "mac_s" in row or "lz4_s" in row:
        s += f" (with MAC/LZ4 floors {work_floor_s(row) / row['load_s']:4.0%})"
    if "load_cold_s" in row:
        s += (f" | cold: load {gbps(row['kv_bytes'], row['load_cold_s']):5.2f}, floor "
              f"{gbps(floor_bytes, row['floor_cold_s']):5.2f} GB/s, {row['floor_cold_s'] / row['load_cold_s']:4.0%}")
    return s


def growth(rows: list[dict]) -> list[dict]:
    """Per (tier, codec, integrity): seconds = a + b * tokens, fitted over the token counts."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["tier"], r["layout"], r["codec"], r["integrity"]), []).append(r)
    for (tier, layout, codec, integrity), rs in groups.items():
        if len(rs) < 2:
            continue
        xs = [r["tokens"] for r in rs]
        ys = [r["load_s"] for r in rs]
        slope, intercept = statistics.linear_regression(xs, ys)
        out.append({"tier": tier, "layout": layout, "codec": codec, "integrity": integrity, "us_per_token": slope * 1e6,
                    "constant_ms": intercept * 1e3,
                    "s_per_token_by_length": {str(x): y / x * 1e6 for x, y in zip(xs, ys)}})
    return out


# ---- warm TTFT against its floor ----------------------------------------------------------
def measure_ttft(model_dir: Path, tokens: int, reps: int) -> dict:
    from connector.engine_connector import build_connector
    from engine import LLM, SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1)
    conn = build_connector(["cpu"], chunk_size=CHUNK)
    llm = LLM(str(model_dir), kv_connector=conn, enable_prefix_caching=True)
    try:
        vocab = llm.model_config.vocab_size
        out: dict[str, list[float]] = {"cold": [], "engine_hit": [], "cpu_load": []}
        for r in range(reps):
            ids = [(7919 * i + 104729 * r) % (vocab - 10) + 5 for i in range(tokens)]

            def ttft(prompt: list[int]) -> float:
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
                return time.perf_counter() - t0
            out["cold"].append(ttft(ids))
            conn.flush(timeout=120)
            out["engine_hit"].append(ttft(ids))  # the engine's prefix cache: one token computed
            llm.reset_prefix_cache()
            out["cpu_load"].append(ttft(ids))  # all but the last token from the cpu tier
        mc = llm.model_config
        kv_bytes = (tokens - 1) * mc.num_layers * 2 * mc.num_kv_heads * mc.head_size * 4
    finally:
        llm.shutdown()
    med = {k: statistics.median(v) for k, v in out.items()}
    floor = med["engine_hit"] + timed(memcpy(kv_bytes), 5)
    return {"tokens": tokens, "kv_bytes": kv_bytes, **{f"{k}_s": v for k, v in med.items()},
            "floor_s": floor, "ratio": med["cpu_load"] / floor, "target": "<= 2.0"}


def profile_loads(tiers: dict[str, str], mc: ModelConfig, n: int) -> str:
    out = io.StringIO()
    for name, url in tiers.items():
        with tier_bench(url, "raw", False, mc, n) as b:
            spans = b.store(list(range(1, n + 1)))
            b.load(spans, n)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(3):
                b.load(spans, n)
            prof.disable()
        out.write(f"\n== {name}: 3 loads of {n} tokens (cProfile sees this thread only: the loader's "
                  "own time shows here as waits)\n")
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    return out.getvalue()


def render_md(res: dict) -> str:
    lines = ["# Load speed against this machine's floor (benchmarks/bench_load.py)", "",
             f"{res['machine']}; torch threads {res['threads']}; model geometry {res['geometry']}; "
             f"chunk {CHUNK} tokens; blocks: kvtier's engine layout, or vLLM's CPU one (K transposed per block); "
             f"minimum of {res['reps']} loads (4096 / tokens times as many below 4096 tokens) after a warm-up, "
             "each load timed in turn with its floor. "
             "Load GB/s counts the K/V "
             "bytes scattered into blocks; the floor counts the bytes it moves (K/V for memcpy, stored values "
             "for files and transports). Share = floor time / load time (target >= 50%). With a MAC or "
             "the lz4 codec, a load also hashes and decompresses: `MAC GB/s` is keyed BLAKE3 over the "
             "same stored values, `LZ4 GB/s` the codec library decompressing their payloads into a reused "
             "buffer (K/V bytes out), each on one core; `+work share` = (floor + MAC + LZ4 time) / load "
             "time, the share of that work done serially on one core.", "",
             "| tier | blocks | codec | MAC | tokens | load GB/s | floor GB/s | share | MAC GB/s | LZ4 GB/s "
             "| +work share | cold load GB/s | cold floor GB/s | cold share |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        fb = r.get("stored_bytes", r["kv_bytes"])
        cold = ["", "", ""]
        if "load_cold_s" in r:
            cold = [f"{gbps(r['kv_bytes'], r['load_cold_s']):.2f}", f"{gbps(fb, r['floor_cold_s']):.2f}",
                    f"{r['floor_cold_s'] / r['load_cold_s']:.0%}"]
        mac = "on" if r["integrity"] else "off"
        work = [f"{gbps(fb, r['mac_s']):.2f}" if "mac_s" in r else "",
                f"{gbps(r['kv_bytes'], r['lz4_s']):.2f}" if "lz4_s" in r else "",
                f"{work_floor_s(r) / r['load_s']:.0%}" if "mac_s" in r or "lz4_s" in r else ""]
        lines.append(f"| {r['tier']} | {r['layout']} | {r['codec']} | {mac} | {r['tokens']} | "
                     f"{gbps(r['kv_bytes'], r['load_s']):.2f} | {gbps(fb, r['floor_s']):.2f} | "
                     f"{r['floor_s'] / r['load_s']:.0%} | " + " | ".join(work + cold) + " |")
    lines += ["", "Growth with length (least squares over the token counts: seconds = constant + per-token x "
              "tokens):", "", "| tier | blocks | codec | MAC | us per token | constant ms |",
              "|---|---|---|---|---:|---:|"]
    for g in res["growth"]:
        lines.append(f"| {g['tier']} | {g['layout']} | {g['codec']} | {'on' if g['integrity'] else 'off'} | "
                     f"{g['us_per_token']:.2f} | {g['constant_ms']:.1f} |")
    t = res.get("ttft")
    if t:
        lines += ["", f"Warm TTFT of a {t['tokens']}-token prompt from the cpu tier: {t['cpu_load_s'] * 1e3:.0f} ms; "
                  f"one-token forward (engine prefix-cache hit) {t['engine_hit_s'] * 1e3:.0f} ms + memcpy floor of "
                  f"its K/V ({t['kv_bytes'] / 1e6:.0f} MB) = {t['floor_s'] * 1e3:.0f} ms; ratio {t['ratio']:.2f}x "
                  f"(target {t['target']}); cold {t['cold_s'] * 1e3:.0f} ms."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, one codec; writes no results")
    ap.add_argument("--tiers", default="cpu,disk,redis,kvtier")
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--codecs", default="raw,lz4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ttft", action="store_true", help="also the warm TTFT of a 2k prompt against its floor")
    ap.add_argument("--profile", action="store_true", help="print where a 4k load's time goes per tier")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bundled SmolLM2)")
    args = ap.parse_args()
    tokens = [256, 1024] if args.quick else [int(t) for t in args.tokens.split(",")]
    codecs = ["raw"] if args.quick else args.codecs.split(",")
    reps = 1 if args.quick else args.reps
    from engine.default_model import ensure_default_model

    model_dir = Path(args.model) if args.model else ensure_default_model()
    mc = ModelConfig.from_pretrained(model_dir)
    wanted = args.tiers.split(",")
    unknown = set(wanted) - {"cpu", "disk", "redis", "kvtier"}
    if unknown:
        ap.error(f"unknown tier(s) {sorted(unknown)}")
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-load-", dir=REPO / "build" if (REPO / "build").is_dir()
                                 else None))
    procs: list = []  # servers started here (a RedisServer, a CacheServerProcess): stopped at the end
    tiers: dict[str, str] = {}
    try:
        for name in wanted:
            if name == "cpu":
                tiers[name] = "cpu?budget=2GiB"
            elif name == "disk":
                tiers[name] = f"disk://{work / 'disk'}?budget=4GiB"
            elif name == "redis":
                from harness.redis import start_redis

                server = start_redis()
                procs.append(server)
                tiers[name] = server.url
            else:
                from harness.cache_server import CacheServerProcess

                cs = CacheServerProcess("--max-bytes", "4GiB")
                procs.append(cs)
                tiers[name] = cs.url
        if args.profile:
            print(profile_loads(tiers, mc, 4096))
            return 0
        rows = []
        for name, url in tiers.items():
            rows += measure_tier(name, url, mc, tokens, codecs, reps, work / "disk" if name == "disk" else None)
        if "cpu" in tiers and not args.quick:  # vLLM's CPU blocks: another scatter, the same fetch
            rows += measure_tier("cpu", tiers["cpu"], mc, tokens, ["raw"], reps, None, "vllm-cpu")
        res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads": torch.get_num_threads(),
               "geometry": f"{mc.num_layers} layers x {mc.num_kv_heads} KV heads x {mc.head_size}, fp32",
               "reps": reps, "rows": rows, "growth": growth(rows)}
        if args.ttft:
            res["ttft"] = measure_ttft(model_dir, 256 if args.quick else 2048, 1 if args.quick else 3)
        md = render_md(res)
        print(md)
        if not args.quick:
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / "load.json").write_text(json.dumps(res, indent=2) + "\n")
            (RESULTS / "load.md").write_text(md)
        return 0
    finally:
        for p in procs:
            p.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
