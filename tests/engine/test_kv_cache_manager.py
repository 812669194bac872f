"""KVCacheManager: prefix matching, atomic slot allocation, publishing full blocks, freeing."""

from __future__ import annotations

from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.kvcache.block_hash import block_hashes, root_hash
from tandem.types import Request, SamplingParams

B = 4


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, list(prompt), SamplingParams())


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> int:
    """What the scheduler does on admission; returns the number of cached tokens."""
    blocks, num_cached = kv.get_computed_blocks(req)
    assert num_cached == len(blocks) * kv.block_size
    if num_new is None:
        num_new = req.num_tokens - num_cached
    assert kv.allocate_slots(req, num_new, blocks)
    kv.record_prefix_lookup(req, num_cached)
    req.num_computed_tokens = num_cached
    return num_cached


def compute(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """The model ran `num_tokens` more positions (slots were allocated for them)."""
    req.num_computed_tokens += num_tokens
    assert len(kv.blocks_of(req.request_id)) >= -(-req.num_computed_tokens // kv.block_size)
    kv.cache_computed_blocks(req)


def prefill(kv: KVCacheManager, req: Request) -> int:
    num_cached = admit(kv, req)
    compute(kv, req, req.num_tokens - num_cached)
    return num_cached


def decode(kv: KVCacheManager, req: Request, token: int) -> None:
    req.append_output_token(token)
    assert kv.allocate_slots(req, 1)
    compute(kv, req, 1)


PROMPT = list(range(10, 24))  # 14 tokens: 3 full blocks + 2


def test_first_request_has_no_hit(make_kv) -> None:
    kv = make_kv()
    req = request("a", PROMPT)
    assert kv.get_computed_blocks(req) == ([], 0)
    assert (kv.stats.queries, kv.stats.hits) == (0, 0)  # a lookup alone is not counted
    assert kv.blocks_of("a") == [] and kv.block_ids_of("a") == []


def test_prefix_hit_unaligned_prompt(make_kv) -> None:
    kv = make_kv()
    a, b = request("a", PROMPT), request("b", PROMPT)
    assert prefill(kv, a) == 0
    assert kv.pool.num_cached_blocks == 3  # the partial fourth block is not published
    assert prefill(kv, b) == 12
    assert kv.block_ids_of("b")[:3] == kv.block_ids_of("a")[:3]
    assert kv.block_ids_of("b")[3] != kv.block_ids_of("a")[3]
    assert [blk.ref_count for blk in kv.blocks_of("b")] == [2, 2, 2, 1]
    assert (kv.stats.queries, kv.stats.hits) == (28, 12)
    kv.free(a)
    kv.free(b)


def test_prefix_hit_block_aligned_prompt_leaves_one_block_to_compute(make_kv) -> None:
    kv = make_kv()
    prompt = PROMPT[:12]  # exactly 3 blocks
    a, b = request("a", prompt), request("b", prompt)
    prefill(kv, a)
    assert kv.pool.num_cached_blocks == 3
    blocks, num_cached = kv.get_computed_blocks(b)
    # The last prompt token must run through the model to produce logits, so its whole
    # block is recomputed even though it is cached.
    assert num_cached == 8
    assert blocks == kv.blocks_of("a")[:2]
    assert kv.allocate_slots(b, 4, blocks)
    assert len(kv.blocks_of("b")) == 3
    assert kv.blocks_of("b")[2] is not kv.blocks_of("a")[2]
    b.num_computed_tokens = 8
    compute(kv, b, 4)
    assert kv.blocks_of("b")[2].block_hash is None  # its hash already has a block
    kv.free(a)
    kv.free(b)


def test_one_token_and_one_block_prompts_compute_everything(make_kv) -> None:
    kv = make_kv()
    for prompt in ([5], [5, 6, 7, 8]):
        first, second = request("first", prompt), request("second", prompt)
        prefill(kv, first)
        assert kv.get_computed_blocks(second) == ([], 0)
        kv.free(first)


def test_partial_prefix_hit(make_kv) -> None:
    kv = make_kv()
    a = request("a", PROMPT)
    prefill(kv, a)
    other = PROMPT[:4] + [99] + PROMPT[5:]  # diverges in the second block
    b = request("b", other)
    assert prefill(kv, b) == 4
    assert kv.block_ids_of("b")[0] == kv.block_ids_of("a")[0]
    assert len(set(kv.block_ids_of("b")[1:]) & set(kv.block_ids_of("a"))) == 0
    kv.free(a)
    kv.free(b)


def test_hit_after_the_first_request_finished_revives_its_blocks(make_kv) -> None:
    kv = make_kv(num_blocks=8)
    a = request("a", PROMPT)
    prefill(kv, a)
    a_ids = kv.block_ids_of("a")
    kv.free(a)
    assert kv.pool.num_free_blocks == 8
    b = request("b", PROMPT)
    assert prefill(kv, b) == 12
    assert kv.block_ids_of("b")[:3] == a_ids[:3]
    assert kv.pool.num_free_blocks == 4
    assert [blk.ref_count for blk in kv.blocks_of("b")] == [1, 1, 1, 1]
    kv.free(b)


def test_generated_tokens_are_cached_too(make_kv) -> None:
    """A multi-turn follow-up reuses the blocks the previous answer filled during decode."""
    kv = make_kv()
    a = request("a", PROMPT)
    prefill(kv, a)
    for token in (500, 501, 502, 503, 504):
        decode(kv, a, token)
    # 14 prompt + 5 output = 19 tokens, 18 computed: 4 full blocks.
    assert kv.pool.num_cached_blocks == 4
    follow_up = request("b", a.all_token_ids + [7, 7, 7])
    assert prefill(kv, follow_up) == 16
    assert kv.block_ids_of("b")[:4] == kv.block_ids_of("a")[:4]
    kv.free(a)
    kv.free(follow_up)


def test_cached_hashes_follow_the_chain(make_kv) -> None:
    kv = make_kv()
    a = request("a", PROMPT)
    prefill(kv, a)
    expected = block_hashes(PROMPT, B, kv.root_hash)
    assert [blk.block_hash for blk in kv.blocks_of("a")] == [*expected, None]
    for index, blk in enumerate(kv.blocks_of("a")[:3]):
        assert blk.token_ids == tuple(PROMPT[index * B : (index + 1) * B])
    kv.free(a)


def test_cache_computed_blocks_only_publishes_full_computed_blocks(make_kv) -> None:
    kv = make_kv()
    a = request("a", PROMPT)
    admit(kv, a, num_new=14)
    kv.cache_computed_blocks(a)  # nothing computed yet
    assert kv.pool.num_cached_blocks == 0
    compute(kv, a, 3)
    assert kv.pool.num_cached_blocks == 0
    compute(kv, a, 2)  # 5 computed: block 0 is full
    assert kv.pool.num_cached_blocks == 1
    compute(kv, a, 6)  # 11 computed: blocks 0 and 1
    assert kv.pool.num_cached_blocks == 2
    compute(kv, a, 3)  # 14 computed: three full blocks, the fourth has two tokens
    assert kv.pool.num_cached_blocks == 3
    assert kv.blocks_of("a")[3].block_hash is None
    kv.cache_computed_blocks(a)  # idempotent
    assert kv.pool.num_cached_blocks == 3
    kv.free(a)


def test_chunked_prefill_allocates_as_it_goes(make_kv) -> None:
    kv = make_kv()
    a = request("a", PROMPT)
    admit(kv, a, num_new=5)
    assert len(kv.blocks_of("a")) == 2
    compute(kv, a, 5)
    assert kv.allocate_slots(a, 3)  # up to 8: still two blocks
    assert len(kv.blocks_of("a")) == 2
    compute(kv, a, 3)
    assert kv.allocate_slots(a, 6)  # up to 14: four blocks
    assert len(kv.blocks_of("a")) == 4
    kv.free(a)


def test_allocate_slots_fails_atomically_for_a_new_request(make_kv) -> None:
    kv = make_kv(num_blocks=4)
    a = request("a", PROMPT[:9])
    prefill(kv, a)  # 3 blocks
    before = [(blk.ref_count, blk.block_hash) for blk in kv.pool.blocks]
    b = request("b", [1] * 8)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert not kv.allocate_slots(b, 8)
    assert kv.blocks_of("b") == []
    assert kv.pool.num_free_blocks == 1
    assert [(blk.ref_count, blk.block_hash) for blk in kv.pool.blocks] == before
    kv.free(b)  # freeing a request that holds nothing is harmless
    kv.free(a)


def test_allocate_slots_fails_atomically_with_idle_cached_hits(make_kv) -> None:
    """Reviving idle cached blocks uses free blocks too: count them before touching anything."""
    kv = make_kv(num_blocks=4)
    a = request("a", PROMPT[:8])
    prefill(kv, a)
    kv.free(a)  # blocks 0 and 1 idle but cached
    filler = request("filler", [1] * 8)
    prefill(kv, filler)  # takes the two never-cached blocks
    assert kv.pool.num_free_blocks == 2
    b = request("b", PROMPT[:8] + [3] * 5)  # 13 tokens: 2 hit blocks + 2 new ones
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    before = [(blk.ref_count, blk.block_hash) for blk in kv.pool.blocks]
    assert not kv.allocate_slots(b, 5, blocks)
    assert kv.blocks_of("b") == []
    assert kv.pool.num_free_blocks == 2
    assert [(blk.ref_count, blk.block_hash) for blk in kv.pool.blocks] == before
    assert all(blk.ref_count == 0 and blk.block_hash is not None for blk in blocks)
    kv.free(filler)
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    assert kv.allocate_slots(b, 5, blocks)
    assert kv.blocks_of("b")[:2] == blocks
    kv.free(b)


def test_allocate_slots_fails_atomically_for_a_running_request(make_kv) -> None:
    kv = make_kv(num_blocks=3)
    a = request("a", PROMPT[:6])
    prefill(kv, a)
    held = kv.block_ids_of("a")
    assert not kv.allocate_slots(a, 8)  # would need 4 blocks in all
    assert kv.block_ids_of("a") == held
    assert kv.pool.num_free_blocks == 1
    assert kv.allocate_slots(a, 6)  # exactly 3 blocks
    assert kv.pool.num_free_blocks == 0
    kv.free(a)


def test_allocate_zero_new_tokens_is_free(make_kv) -> None:
    kv = make_kv(num_blocks=2)
    a = request("a", [1, 2, 3])
    admit(kv, a, num_new=3)
    compute(kv, a, 3)
    assert kv.allocate_slots(a, 0)
    assert kv.allocate_slots(a, 1)
    assert len(kv.blocks_of("a")) == 1
    kv.free(a)


def test_forced_hash_collision_is_not_a_hit(make_kv) -> None:
    kv = make_kv()
    victim = request("victim", PROMPT)
    first_hash = block_hashes(PROMPT, B, kv.root_hash)[0]
    (impostor,) = kv.pool.allocate(1)
    assert kv.pool.cache(impostor, first_hash, [9, 9, 9, 9])
    kv.pool.free([impostor])
    assert kv.get_computed_blocks(victim) == ([], 0)
    assert kv.stats.hits == 0


def test_free_returns_every_block_and_keeps_shared_ones(make_kv) -> None:
    kv = make_kv(num_blocks=8)
    a, b = request("a", PROMPT), request("b", PROMPT)
    prefill(kv, a)
    prefill(kv, b)
    assert kv.pool.num_used_blocks == 5  # 3 shared + 1 each
    kv.free(a)
    assert kv.blocks_of("a") == []
    assert kv.pool.num_used_blocks == 4
    assert all(blk.ref_count == 1 for blk in kv.blocks_of("b"))
    kv.free(b)
    assert kv.pool.num_free_blocks == 8
    kv.free(b)  # a second free of the same request is a no-op, not a double free
    assert kv.pool.num_free_blocks == 8


def test_free_puts_the_tail_first_in_line_for_eviction(make_kv) -> None:
    kv = make_kv(num_blocks=4)
    a = request("a", PROMPT[:13])  # 3 full blocks + 1 token
    prefill(kv, a)
    a_ids = kv.block_ids_of("a")
    kv.free(a)
    # The next request takes the unhashed partial block, then the tail of the cached prefix.
    other = request("other", [1] * 8)
    prefill(kv, other)
    assert kv.block_ids_of("other") == [a_ids[3], a_ids[2]]
    kv.free(other)
    b = request("b", PROMPT[:13])
    assert prefill(kv, b) == 8
    assert kv.block_ids_of("b")[:2] == a_ids[:2]
    kv.free(b)


def test_stats_count_prompt_tokens_looked_up_and_hit(make_kv) -> None:
    kv = make_kv()
    a, b, c = request("a", PROMPT), request("b", PROMPT), request("c", PROMPT[:4] + [0] * 6)
    prefill(kv, a)
    prefill(kv, b)
    prefill(kv, c)
    assert (kv.stats.queries, kv.stats.hits) == (14 + 14 + 10, 12 + 4)
    for req in (a, b, c):
        kv.free(req)


def test_same_prompt_computed_twice_at_once(make_kv) -> None:
    """Two identical prompts admitted in one step both compute; the first to finish publishes."""
    kv = make_kv()
    a, b = request("a", PROMPT), request("b", PROMPT)
    admit(kv, a)
    admit(kv, b)
    compute(kv, a, 14)
    compute(kv, b, 14)
    assert kv.pool.num_cached_blocks == 3
    assert all(blk.block_hash is None for blk in kv.blocks_of("b"))
    kv.free(a)
    c = request("c", PROMPT)
    assert prefill(kv, c) == 12
    kv.free(b)
    kv.free(c)


def test_caching_disabled(make_kv) -> None:
    kv = make_kv(enable_caching=False)
    assert not kv.enable_caching
    a, b = request("a", PROMPT), request("b", PROMPT)
    assert prefill(kv, a) == 0
    assert prefill(kv, b) == 0
    assert kv.pool.num_cached_blocks == 0
    assert (kv.stats.queries, kv.stats.hits) == (0, 0)
    kv.free(a)
    kv.free(b)


# --- blocks a KV connector holds or fills ------------------------------------------------
def test_held_prompt_blocks_outlive_the_request() -> None:
    pool = BlockPool(8)
    manager = KVCacheManager(pool, 4, root_hash("m", "float32", 4))
    request = Request("r", list(range(10)), SamplingParams())
    assert manager.allocate_slots(request, 10)
    request.num_computed_tokens = 10
    manager.cache_computed_blocks(request)
    kept = manager.free(request, hold_blocks=2)  # the 2 full prompt blocks, for a handoff
    assert [b.block_id for b in kept] == [0, 1] and all(b.ref_count == 1 for b in kept)
    assert pool.num_used_blocks == 2 and manager.blocks_of("r") == []
    manager.release(kept)
    assert pool.num_used_blocks == 0


def test_free_holds_nothing_by_default() -> None:
    pool = BlockPool(8)
    manager = KVCacheManager(pool, 4, root_hash("m", "float32", 4))
    request = Request("r", list(range(10)), SamplingParams())
    assert manager.allocate_slots(request, 10)
    assert manager.free(request) == [] and pool.num_used_blocks == 0


def test_loaded_blocks_become_prefix_hits() -> None:
    """Blocks a connector filled count as computed, and are published like computed ones."""
    pool = BlockPool(8)
    manager = KVCacheManager(pool, 4, root_hash("m", "float32", 4))
    tokens = list(range(13))
    loader = Request("loader", tokens, SamplingParams())
    assert manager.cached_prefix_blocks(loader) == 0
    assert manager.allocate_slots(loader, 12)  # room for the 3 full blocks that arrive
    loader.num_computed_tokens = 12  # the load finished
    manager.cache_computed_blocks(loader)
    assert manager.cached_prefix_blocks(loader) == 3
    loaded = manager.block_ids_of("loader")
    manager.free(loader)
    request = Request("r", tokens, SamplingParams())
    hits, num_cached = manager.get_computed_blocks(request)
    assert [b.block_id for b in hits] == loaded and num_cached == 12


def test_block_hashes_are_computed_once_and_kept_on_the_request(make_kv, monkeypatch) -> None:
    from tandem.engine import kv_cache_manager

    kv = make_kv()
    calls = []
    real = kv_cache_manager.block_hashes

    def counting(tokens, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        result = real(tokens, *args, **kwargs)
        calls.append(len(result))
        return result

    monkeypatch.setattr(kv_cache_manager, "block_hashes", counting)
    req = request("a", PROMPT)  # 14 tokens: 3 full blocks
    kv.update_block_hashes(req)
    prefill(kv, req)
    kv.cached_prefix_blocks(req)
    assert sum(calls) == 3 and len(req.block_hashes) == 3
    for token in (1, 2):  # the 16th token fills block 4: hashed once, when it fills
        decode(kv, req, token)
    assert sum(calls) == 4 and len(req.block_hashes) == 4
    kv.free(req)


def test_cache_salt_separates_chains(make_kv) -> None:
    kv = make_kv()
    plain = request("plain", PROMPT)
    prefill(kv, plain)
    salted = Request("salted", list(PROMPT), SamplingParams(), cache_salt="tenant-a")
    assert kv.get_computed_blocks(salted) == ([], 0)  # same tokens, another tenant: no hit
    assert salted.block_hashes[0] != plain.block_hashes[0]
    prefill(kv, salted)
    again = Request("again", list(PROMPT), SamplingParams(), cache_salt="tenant-a")
    assert kv.get_computed_blocks(again)[1] == 12  # same salt: hits
    kv.free(plain)
    kv.free(salted)
