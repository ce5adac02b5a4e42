"""PrefixAffinityPolicy: routes by the engine's own block keys, falls back to the least-loaded
replica past the imbalance threshold, never lets one tenant's history draw another's prompt."""

import pytest

from prefixrag.app.replicas.prefix_affinity import (
    AffinityConfig,
    PrefixAffinityPolicy,
    ReplicaLoad,
)
from prefixrag.engine.kv_cache.block_pool import BlockPool
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.kv_cache.radix_cache import RadixCache, chained_block_keys

BS = 4
REPLICAS = ("r0", "r1", "r2")


def idle(*replicas: str) -> dict[str, ReplicaLoad]:
    return {r: ReplicaLoad() for r in replicas or REPLICAS}


def make_policy(**kwargs) -> PrefixAffinityPolicy[str]:
    return PrefixAffinityPolicy(AffinityConfig(block_size=BS, **kwargs))


def route(policy: PrefixAffinityPolicy[str], tokens, scope, loads) -> str:
    """Choose and record, as the router does once the request is sent."""
    keys = policy.prefix_keys(tokens, scope)
    decision = policy.choose(keys, loads)
    policy.record(decision.replica, keys)
    return decision.replica


def test_chained_keys_are_the_radix_trees_own() -> None:
    # The reference: the keys of the nodes the tree creates for the same tokens and scope.
    cache = RadixCache(BS, BlockPool(32))
    tokens = list(range(100, 123))  # 5 full blocks and 3 tokens more
    scope = CacheScope("tenant-a", num_public_tokens=8)
    blocks = cache.block_pool.allocate(5)
    node = cache.insert(tokens, blocks, scope).last_node
    tree_keys = []
    while node.parent is not None:
        tree_keys.append(node.key)
        node = node.parent
    assert chained_block_keys(tokens, scope, BS) == tree_keys[::-1]
    assert chained_block_keys(tokens, scope, BS, max_num_blocks=2) == tree_keys[::-1][:2]


def test_routing_keys_skip_the_public_head_pinned_everywhere() -> None:
    policy = make_policy()
    tokens = list(range(16))
    scope = CacheScope("t", num_public_tokens=8)
    assert policy.prefix_keys(tokens, scope) == chained_block_keys(tokens, scope, BS)[2:]


def test_a_follow_up_goes_where_its_prefix_is_cached() -> None:
    policy = make_policy(imbalance_threshold=2)
    scope = CacheScope("t")
    first = list(range(40))
    home = route(policy, first, scope, idle())
    # its home is a little busier than the others, within the threshold: affinity still wins
    loads = idle()
    loads[home] = ReplicaLoad(num_queued=2)
    decision = policy.choose(policy.prefix_keys([*first, 7, 8, 9, 10, 11], scope), loads)
    assert (decision.replica, decision.reason) == (home, "affinity")
    assert decision.num_matched_blocks == len(first) // BS


def test_the_longest_match_wins() -> None:
    policy = make_policy()
    scope = CacheScope("t")
    shared = list(range(16))
    policy.record("r0", policy.prefix_keys(shared[:8], scope))
    policy.record("r1", policy.prefix_keys(shared, scope))
    decision = policy.choose(policy.prefix_keys([*shared, 1, 2, 3, 4], scope), idle())
    assert (decision.replica, decision.num_matched_blocks) == ("r1", 4)


def test_past_the_imbalance_threshold_the_least_loaded_serves() -> None:
    policy = make_policy(imbalance_threshold=3)
    scope = CacheScope("t")
    tokens = list(range(32))
    keys = policy.prefix_keys(tokens, scope)
    policy.record("r0", keys)
    at_threshold = {"r0": ReplicaLoad(4), "r1": ReplicaLoad(1), "r2": ReplicaLoad(2)}
    assert policy.choose(keys, at_threshold).replica == "r0"
    past = {"r0": ReplicaLoad(5), "r1": ReplicaLoad(1), "r2": ReplicaLoad(2)}
    decision = policy.choose(keys, past)
    assert (decision.replica, decision.reason) == ("r1", "imbalance")


def test_a_hot_prefix_spreads_while_no_request_finishes() -> None:
    threshold = 2
    policy = make_policy(imbalance_threshold=threshold)
    scope = CacheScope("t")
    hot = list(range(64))
    loads = idle()
    for i in range(60):
        replica = route(policy, [*hot, 1000 + i], scope, loads)  # each adds one to a queue
        loads[replica] = ReplicaLoad(loads[replica].num_queued + 1)
    queued = [load.num_queued for load in loads.values()]
    assert sum(queued) == 60
    # no replica idles, and none runs more than the threshold (plus the one just sent) ahead
    assert max(queued) - min(queued) <= threshold + 1
    # and, once every replica holds the prefix, each later pick is by load among holders
    assert all(policy.num_matched_blocks(r, policy.prefix_keys(hot, scope)) > 0 for r in loads)


def test_tenants_never_follow_each_others_history() -> None:
    policy = make_policy()
    tokens = list(range(40))
    public = CacheScope("alice", num_public_tokens=8)
    home = route(policy, tokens, public, idle())
    # bob sends the very same tokens: his keys are salted with his name past the public head
    bob = CacheScope("bob", num_public_tokens=8)
    bob_keys = policy.prefix_keys(tokens, bob)
    assert not set(bob_keys) & set(policy.prefix_keys(tokens, public))
    assert all(policy.num_matched_blocks(r, bob_keys) == 0 for r in REPLICAS)
    # so where bob goes depends on load alone: here alice's home is the busier one
    loads = idle()
    loads[home] = ReplicaLoad(1)
    decision = policy.choose(bob_keys, loads)
    assert decision.reason == "least_loaded"
    assert decision.replica != home


def test_new_conversations_spread_over_idle_replicas() -> None:
    policy = make_policy()
    scope = CacheScope("t")
    homes = [route(policy, [c] * 24, scope, idle()) for c in range(6)]
    assert sorted(homes) == sorted(REPLICAS * 2)


def test_memory_is_bounded_and_forgets_the_oldest() -> None:
    policy = make_policy(max_keys_per_replica=8)
    scope = CacheScope("t")
    old = policy.prefix_keys(list(range(32)), scope)  # 8 keys
    policy.record("r0", old)
    new = policy.prefix_keys(list(range(500, 516)), scope)  # 4 more
    policy.record("r0", new)
    assert policy.num_remembered("r0") == 8
    assert policy.num_matched_blocks("r0", old) == 0  # its first blocks went first
    assert policy.num_matched_blocks("r0", new) == 4


def test_a_dead_replica_is_forgotten() -> None:
    policy = make_policy()
    scope = CacheScope("t")
    keys = policy.prefix_keys(list(range(16)), scope)
    policy.record("r0", keys)
    policy.record("r1", keys)
    policy.retain(["r1", "r2"])
    assert policy.num_remembered("r0") == 0
    assert policy.num_matched_blocks("r1", keys) == 4
    policy.forget("r1")
    assert policy.choose(keys, idle("r1", "r2")).reason == "least_loaded"


def test_bad_config_and_loads_are_refused() -> None:
    with pytest.raises(ValueError):
        AffinityConfig(block_size=0)
    with pytest.raises(ValueError):
        AffinityConfig(imbalance_threshold=-1)
    with pytest.raises(ValueError):
        ReplicaLoad(num_queued=-1)
    with pytest.raises(ValueError):
        ReplicaLoad(cache_occupancy=1.5)
    with pytest.raises(ValueError):
        make_policy().choose([], {})


def test_the_replicas_own_report_only_breaks_ties() -> None:
    policy = make_policy()
    # a report can be a stats period old: the router's own count comes first
    loads = {"r0": ReplicaLoad(num_queued=0, num_reported=3), "r1": ReplicaLoad(num_queued=1)}
    assert policy.choose([], loads).replica == "r0"
    loads = {"r0": ReplicaLoad(num_reported=1), "r1": ReplicaLoad()}
    assert policy.choose([], loads).replica == "r1"
