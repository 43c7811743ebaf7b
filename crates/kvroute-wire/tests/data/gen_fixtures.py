#!/usr/bin/env python3
"""Generates the msgpack fixtures of kvroute-wire's tests with msgspec, the library vLLM encodes
its KV events with.

Run it by hand when a fixture is added or changed; the Rust tests read the `.hex` files it
writes and never run Python:

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install msgspec
    /tmp/venv/bin/python crates/kvroute-wire/tests/data/gen_fixtures.py

The structs below mirror `vllm/distributed/kv_events.py` (and SGLang's copy of it) at the
revisions named in each schema's docstring: field order is declaration order, and the flags
(`array_like`, `omit_defaults`, `tag`) are vLLM's. Each `.hex` file holds one payload: comment
lines starting with `#` say what it is, then the bytes as hex, 64 characters a line.

Note what msgspec does with `omit_defaults`: map-encoded structs leave out every field equal to
its default, wherever it stands; `array_like` structs ignore the flag and always write every
field (checked against msgspec 0.18.6 and 0.22.0). Positional arrays differ in length only
between schema revisions.
"""

import hashlib
import pathlib
from typing import Any

import msgspec

OUT = pathlib.Path(__file__).resolve().parent


def schema(*, events_array_like: bool, batch_array_like: bool, revision: str) -> dict[str, type]:
    """One revision of vLLM's event structs, as a dict of class name to class.

    `revision` is one of:
    * "2025": the original schema (vllm b4e69e0, SGLang until 2026): no medium, lora_name,
      group_idx or data_parallel_rank.
    * "sglang": SGLang's later schema: `medium` but no `lora_name`; no data_parallel_rank.
    * "2026-positional": vLLM's last positional revision (before PR #42892): medium, lora_name,
      extra_keys, group_idx and the cache-spec fields.
    * "2026": the newest revision (map events), which adds locality and ownership.
    """
    ev = dict(array_like=events_array_like, omit_defaults=True, gc=False, tag=True)
    ExternalBlockHash = int | bytes
    newest = revision == "2026"
    vllm_2026 = revision.startswith("2026")

    # Class bodies may declare fields conditionally; msgspec sees the annotations that ran.
    class BlockStored(msgspec.Struct, **ev):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        if revision == "sglang":
            medium: str | None = None
        if vllm_2026:
            medium: str | None
            lora_name: str | None
            extra_keys: list[tuple[Any, ...] | None] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None
        if newest:
            locality: str | None = None
            ownership: str | None = None

    class BlockRemoved(msgspec.Struct, **ev):
        block_hashes: list[ExternalBlockHash]
        if revision == "sglang":
            medium: str | None = None
        if vllm_2026:
            medium: str | None
            group_idx: int | None = None
        if newest:
            locality: str | None = None
            ownership: str | None = None

    class EventBatch(msgspec.Struct, array_like=batch_array_like, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        if vllm_2026:
            data_parallel_rank: int | None = None

    class AllBlocksCleared(msgspec.Struct, **ev):
        pass

    class BlockPinned(msgspec.Struct, **ev):
        """An event type no vLLM release has: stands for one added after this decoder."""

        block_hashes: list[ExternalBlockHash]
        reason: str

    return {c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared, BlockPinned, EventBatch)}


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def digest(i: int) -> bytes:
    """A 32-byte block hash as vLLM sends it with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0."""
    return hashlib.sha256(f"block {i}".encode()).digest()


def write(name: str, what: str, payload: bytes) -> None:
    text = "".join(f"# {line}\n" for line in what.strip().splitlines())
    hexed = payload.hex()
    text += "".join(hexed[i : i + 64] + "\n" for i in range(0, len(hexed), 64))
    (OUT / f"{name}.hex").write_text(text)


ENC = msgspec.msgpack.Encoder()


def shared_2026_events(s: dict[str, type]) -> list[Any]:
    """The events of the two byte-exact fixtures (positional_2026 and map_2026): only fields the
    Rust encoder emits, with ints of every msgpack width and a str8 LoRA name."""
    return [
        s["BlockStored"](
            block_hashes=[5, 200, 70_000, 1 << 40, (1 << 64) - 1],
            parent_block_hash=None,
            token_ids=tokens(0, 18) + [70_000, 4_000_000_000],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        s["BlockStored"](
            block_hashes=[0x1122334455667788],
            parent_block_hash=(1 << 64) - 1,
            token_ids=[9, 8, 7, 6],
            block_size=4,
            lora_id=3,
            medium="GPU",
            lora_name="adapter-with-a-rather-long-name-0123456789",
            group_idx=0,
        ),
        s["BlockRemoved"](block_hashes=[200], medium="GPU"),
        s["BlockRemoved"](block_hashes=[5, 1 << 40], medium="GPU", group_idx=1),
        s["AllBlocksCleared"](),
    ]


def main() -> None:
    # 1. The original 2025 schema, positional, no data_parallel_rank.
    s = schema(events_array_like=True, batch_array_like=True, revision="2025")
    batch = s["EventBatch"](
        ts=1745000000.5,
        events=[
            s["BlockStored"]([11, 12], None, tokens(100, 8), 4, None),
            s["BlockStored"]([13], 12, tokens(108, 4), 4, 7),
            s["BlockRemoved"]([11]),
            s["AllBlocksCleared"](),
        ],
    )
    write("legacy_2025", "vLLM's original 2025 schema: positional events, [ts, events].", ENC.encode(batch))

    # 2./3. The same events positional (vLLM's last positional revision, before PR #42892) and as
    # maps (PR #42892, v0.26.0) in a positional batch: the Rust encoder must match both byte for byte.
    for array_like, revision, name, what in (
        (True, "2026-positional", "positional_2026", "positional events (before PR #42892)"),
        (False, "2026", "map_2026", "map events (PR #42892), positional envelope"),
    ):
        s = schema(events_array_like=array_like, batch_array_like=True, revision=revision)
        batch = s["EventBatch"](ts=1767225600.123456, events=shared_2026_events(s), data_parallel_rank=1)
        write(name, f"vLLM 2026 schema, {what}. Byte-exact encoder fixture.", ENC.encode(batch))

    # 4./5. Every optional field, future fields and a future event type, in both encodings (the
    # positional one as a positional revision with the newest fields appended would send it).
    for array_like, name in ((True, "positional_2026_extras"), (False, "map_2026_extras")):
        s = schema(events_array_like=array_like, batch_array_like=True, revision="2026")
        batch = s["EventBatch"](
            ts=1767225601.0,
            events=[
                s["BlockStored"](
                    block_hashes=[21, 22],
                    parent_block_hash=None,
                    token_ids=tokens(0, 8),
                    block_size=4,
                    lora_id=None,
                    medium="GPU",
                    lora_name="lora-a",
                    extra_keys=[("lora-a", ("mm-0", 3)), None],
                    group_idx=2,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=128,
                    locality="LOCAL",
                    ownership="tier-1",
                ),
                s["BlockPinned"](block_hashes=[21], reason="future event type"),
                s["BlockRemoved"](block_hashes=[22], medium="GPU", group_idx=2, ownership="tier-1"),
            ],
            data_parallel_rank=0,
        )
        write(
            name,
            f"Every optional 2026 field, future fields and an unknown event type; {'positional' if array_like else 'map'} events.",
            ENC.encode(batch),
        )

    # 6. 32-byte digests as hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), map events.
    s = schema(events_array_like=False, batch_array_like=True, revision="2026")
    batch = s["EventBatch"](
        ts=1767225602.0,
        events=[
            s["BlockStored"]([digest(1), digest(2)], None, tokens(0, 8), 4, None, "GPU", None),
            s["BlockStored"]([digest(3)], digest(2), tokens(8, 4), 4, None, "GPU", None),
            s["BlockRemoved"]([digest(3)], "GPU"),
        ],
        data_parallel_rank=0,
    )
    write("bin_hashes", "Block hashes as 32-byte bin (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0); map events.", ENC.encode(batch))
    # 6b. The same batch with the default setting: vLLM's maybe_convert_block_hash turns each
    # digest into int.from_bytes(digest, "big") & (2**64 - 1).
    as_int = lambda d: None if d is None else int.from_bytes(d, "big") & ((1 << 64) - 1)
    for e in batch.events:
        e.block_hashes = [as_int(d) for d in e.block_hashes]
        if hasattr(e, "parent_block_hash"):
            e.parent_block_hash = as_int(e.parent_block_hash)
    write("bin_hashes_as_int", "bin_hashes as vLLM sends it by default: each digest as its int form.", ENC.encode(batch))

    # 7. SGLang: signed 64-bit hashes, medium but no lora_name, no data_parallel_rank.
    s = schema(events_array_like=True, batch_array_like=True, revision="sglang")
    batch = s["EventBatch"](
        ts=1767225603.0,
        events=[
            s["BlockStored"]([-5, -(1 << 63)], None, tokens(0, 8), 4, None, "GPU"),
            s["BlockStored"]([(1 << 63) - 1], -(1 << 63), tokens(8, 4), 4, None, "GPU"),
            s["BlockRemoved"]([-5], "CPU_PINNED"),
        ],
    )
    write("sglang_negative_hashes", "SGLang's positional schema with negative (i64) hashes; medium, no lora_name.", ENC.encode(batch))

    # 8. A lone AllBlocksCleared, positional, with data_parallel_rank left None: msgspec writes the
    # nil (array_like ignores omit_defaults). Byte-exact too.
    s = schema(events_array_like=True, batch_array_like=True, revision="2026-positional")
    batch = s["EventBatch"](ts=1767225604.0, events=[s["AllBlocksCleared"]()])
    write(
        "all_cleared",
        "Only AllBlocksCleared, positional, data_parallel_rank None (written as nil). Byte-exact encoder fixture.",
        ENC.encode(batch),
    )

    # 9. Offloading: GPU store, then a CPU-tier store without tokens and a CPU-tier removal.
    s = schema(events_array_like=False, batch_array_like=True, revision="2026")
    batch = s["EventBatch"](
        ts=1767225605.0,
        events=[
            s["BlockStored"]([31, 32], None, tokens(0, 8), 4, None, "GPU", None),
            s["BlockStored"]([31, 32], None, [], 4, None, "CPU", None),
            s["BlockRemoved"]([31, 32], "CPU"),
        ],
        data_parallel_rank=0,
    )
    write("removed_cpu", "KV offloading: a GPU store, a CPU store without tokens, a CPU removal; map events.", ENC.encode(batch))

    # 10. The map envelope of vllm 0181ea3 (EventBatch without array_like).
    s = schema(events_array_like=False, batch_array_like=False, revision="2026")
    batch = s["EventBatch"](
        ts=1767225606.0,
        events=[s["BlockStored"]([41], None, tokens(0, 4), 4, None, "GPU", "lora-b"), s["AllBlocksCleared"]()],
        data_parallel_rank=2,
    )
    write("map_envelope", "Map envelope {ts, events, data_parallel_rank} (vllm 0181ea3); map events.", ENC.encode(batch))


if __name__ == "__main__":
    main()
