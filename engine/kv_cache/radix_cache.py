"""Hash-keyed radix tree of full KV blocks: prefix reuse across requests, LRU eviction of leaves.

One node per full block. A node's key is ``hash_fn(parent_key, namespace, block_token_ids)``;
the node also stores its namespace and token ids, and every lookup compares them, so neither a
hash collision nor another tenant's prefix can ever hand out a block of different tokens.

Every lookup and insert takes one :class:`CacheScope`: the full blocks inside its public head go
in the shared namespace ``b""`` (a system prompt every tenant sends), the rest in its own. Being a
prefix, a public head is all a tenant can ever share, so another tenant's private blocks stay out
of reach, even through the timing of a hit.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from prefixrag.engine.kv_cache.block_pool import BlockPool
from prefixrag.engine.kv_cache.cache_scope import CacheScope

HashFn = Callable[[bytes, bytes, Sequence[int]], bytes]


_KEY_HEADER = struct.Struct("<II")
_TOKEN_PACKERS: dict[int, struct.Struct] = {}  # by token count: one per block size in use


def block_key(parent_key: bytes, namespace: bytes, token_ids: Sequence[int]) -> bytes:
    """128-bit BLAKE2b of a length-prefixed, little-endian encoding of the three parts."""
    # NOTE: one buffer and one hash call: a decode step that fills a block hashes it, so this
    # runs for every sequence every block_size steps (the digest equals hashing part by part)
    n = len(token_ids)
    packer = _TOKEN_PACKERS.get(n)
    if packer is None:
        packer = _TOKEN_PACKERS.setdefault(n, struct.Struct(f"<{n}q"))
    data = _KEY_HEADER.pack(len(parent_key), len(namespace)) + parent_key + namespace
    return hashlib.blake2b(data + packer.pack(*token_ids), digest_size=16).digest()


def chained_block_keys(
    token_ids: Sequence[int],
    cache_scope: CacheScope,
    block_size: int,
    *,
    max_num_blocks: int | None = None,
    hash_fn: HashFn = block_key,
) -> list[bytes]:
    """The keys the tree gives the leading full blocks of ``token_ids`` under ``cache_scope``
    (at most ``max_num_blocks``): each block's key chains its parent's, from the root's ``b""``.
    Whoever must agree with the tree on "the same prefix" (a replica router) hashes with this."""
    num_blocks = len(token_ids) // block_size
    if max_num_blocks is not None:
        num_blocks = min(num_blocks, max_num_blocks)
    keys: list[bytes] = []
    parent = b""
    for i in range(num_blocks):
        block_ns = cache_scope.block_namespace(i, block_size)
        parent = hash_fn(parent, block_ns, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        keys.append(parent)
    return keys


class CachedKeys:
    """An immutable snapshot of the tree's block keys: a prefix-length peek for other threads.

    The engine thread mutates the tree between steps; a reader on another thread walking the
    live nodes could meet a half-made insert or eviction. This holds no nodes, only the set of
    keys as one step left them, so a reader sees one whole state, at worst a step old. It
    trusts the 128-bit key alone (the tree also compares tokens): fine for the hint it gives,
    since the namespace is in the key and nothing is served from it.
    """

    __slots__ = ("block_size", "hash_fn", "keys")

    def __init__(self, keys: frozenset[bytes], block_size: int, hash_fn: HashFn) -> None:
        self.keys = keys
        self.block_size = block_size
        self.hash_fn = hash_fn

    def prefix_len(self, token_ids: Sequence[int], cache_scope: CacheScope = CacheScope()) -> int:
        """Leading tokens of ``token_ids`` cached in whole blocks when the snapshot was taken."""
        bs = self.block_size
        parent = b""
        for i in range(len(token_ids) // bs):
            block_ns = cache_scope.block_namespace(i, bs)
            parent = self.hash_fn(parent, block_ns, tuple(token_ids[i * bs : (i + 1) * bs]))
            if parent not in self.keys:
                return i * bs
        return len(token_ids) // bs * bs


class RadixNode:
    """One cached full block. ``lock_ref`` and ``pin_ref`` count holders along the path to root."""

    __slots__ = (
        "block_id",
        "children",
        "key",
        "last_access_time",
        "lock_ref",
        "namespace",
        "parent",
        "pin_ref",
        "token_ids",
    )

    def __init__(
        self,
        key: bytes,
        namespace: bytes,
        token_ids: tuple[int, ...],
        block_id: int,
        parent: RadixNode | None,
    ) -> None:
        self.key = key
        self.namespace = namespace
        self.token_ids = token_ids
        self.block_id = block_id
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.lock_ref = 0
        self.pin_ref = 0
        self.last_access_time = 0

    @property
    def is_pinned(self) -> bool:
        """True while some pin covers this block."""
        return self.pin_ref > 0

    @property
    def is_evictable(self) -> bool:
        """True for an attached, unlocked, unpinned leaf: the only kind ``evict`` may take."""
        return (
            self.parent is not None
            and not self.children
            and self.lock_ref == 0
            and self.pin_ref == 0
        )


class PrefixMatch(NamedTuple):
    """The cached blocks of a query's prefix, its length in tokens, and its deepest node."""

    block_ids: list[int]
    num_tokens: int
    last_node: RadixNode


@dataclass(slots=True)
class InsertResult:
    """What ``insert`` did with the caller's blocks.

    ``block_ids[i]`` is the block the tree now holds for the caller's block i (the caller's own,
    or an existing one with the same tokens). ``duplicate_block_ids`` are the caller's blocks the
    tree did not take because it had them already: free them. Blocks past ``len(block_ids)`` were
    refused (a hash collision, or the cache is off) and stay the caller's.
    """

    block_ids: list[int]
    duplicate_block_ids: list[int]
    last_node: RadixNode


class RadixCache:
    """Prefix cache over a BlockPool: takes ownership of inserted blocks and frees them on eviction.

    With ``enabled=False`` nothing is matched, inserted or pinned, so every block stays with its
    sequence; all else behaves the same. Times come from a logical clock, not wall time.
    """

    def __init__(
        self,
        block_size: int,
        block_pool: BlockPool,
        *,
        enabled: bool = True,
        hash_fn: HashFn = block_key,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.block_pool = block_pool
        self.enabled = enabled
        self._hash_fn = hash_fn
        self.root = RadixNode(b"", b"", (), -1, None)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0
        self._clock = 0
        self._num_nodes = 0
        self._num_protected = 0  # nodes with lock_ref > 0 or pin_ref > 0
        self._num_pinned = 0
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._heap_seq = 0
        # how many attached nodes have each key (several only under a colliding hash_fn)
        self._keys: dict[bytes, int] = {}
        self._snapshot: CachedKeys | None = None  # None once the tree changed since the last

    # -- counters ---------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Blocks held by the tree."""
        return self._num_nodes

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks covered by at least one pin."""
        return self._num_pinned

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks that repeated eviction could free: neither locked nor pinned."""
        return self._num_nodes - self._num_protected

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup of ``num_tokens`` tokens of which ``num_hit_tokens`` were cached."""
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    # -- lookup -----------------------------------------------------------------------------

    def match_prefix(
        self,
        token_ids: Sequence[int],
        cache_scope: CacheScope = CacheScope(),
        *,
        max_num_tokens: int | None = None,
        count_stats: bool = True,
        keys: list[bytes] | None = None,
    ) -> PrefixMatch:
        """The longest cached run of full blocks that starts ``token_ids`` (at most
        ``max_num_tokens`` tokens), refreshing recency along the whole matched path.

        A match never crosses namespaces: past the public head of ``cache_scope`` it only finds
        blocks cached under the same namespace. ``keys`` is an optional memo of this token
        list's block keys, extended in place; pass the same list only with the same tokens,
        scope and cache.
        """
        path = self._walk(token_ids, cache_scope, max_num_tokens, keys)
        num_tokens = len(path) * self.block_size
        if count_stats:
            self.record_query(len(token_ids), num_tokens)
        if not path:
            return PrefixMatch([], 0, self.root)
        now = self._tick()
        for node in path:
            node.last_access_time = now
        self._push_if_evictable(path[-1])
        return PrefixMatch([node.block_id for node in path], num_tokens, path[-1])

    def prefix_len(
        self,
        token_ids: Sequence[int],
        cache_scope: CacheScope = CacheScope(),
        *,
        max_num_tokens: int | None = None,
        keys: list[bytes] | None = None,
    ) -> int:
        """How many tokens ``match_prefix`` would match, without touching recency or counters."""
        path = self._walk(token_ids, cache_scope, max_num_tokens, keys)
        return len(path) * self.block_size

    def cached_keys(self) -> CachedKeys:
        """The tree's keys now, frozen (see CachedKeys); the same object until the tree changes,
        so taking one after every step costs a copy only for steps that cached or evicted."""
        if self._snapshot is None:
            self._snapshot = CachedKeys(frozenset(self._keys), self.block_size, self._hash_fn)
        return self._snapshot

    # -- insertion --------------------------------------------------------------------------

    def insert(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        cache_scope: CacheScope = CacheScope(),
        *,
        parent: RadixNode | None = None,
    ) -> InsertResult:
        """Cache the full blocks of ``token_ids`` (held in ``block_ids``, one per full block;
        extra trailing ids are ignored) below ``parent`` (default: the root).

        ``parent`` lets a sequence add blocks after its already-cached prefix without hashing it
        again; it must be attached and in the same namespace or the shared one.
        The public head of ``cache_scope`` counts from the start of ``token_ids``, not from the
        root (see :meth:`CacheScope.after`).
        """
        ns = cache_scope.namespace.encode()
        node = self.root if parent is None else parent
        self._check_attached(node)
        if node is not self.root and node.namespace not in (ns, b""):
            raise ValueError("insert below a node of another namespace")
        if node.namespace == ns and ns and cache_scope.num_public_blocks(self.block_size):
            raise ValueError("a public block cannot follow a private one")
        num_full = len(token_ids) // self.block_size
        if len(block_ids) < num_full:
            raise ValueError(f"{num_full} full blocks but only {len(block_ids)} block ids")
        if not self.enabled:
            return InsertResult([], [], node)
        for block_id in block_ids[:num_full]:
            if not self.block_pool.is_allocated(block_id):
                raise ValueError(f"block {block_id!r} is not an allocated block of the pool")
        now = self._tick()
        held: list[int] = []
        duplicates: list[int] = []
        for i in range(num_full):
            block_ns = cache_scope.block_namespace(i, self.block_size)
            child = self._child_for(node, block_ns, token_ids, i, block_ids[i])
            if child is None:
                break
            if child.block_id != block_ids[i]:
                duplicates.append(block_ids[i])
            child.last_access_time = now
            held.append(child.block_id)
            node = child
        self._push_if_evictable(node)
        return InsertResult(held, duplicates, node)

    def extend_locked(
        self, parent: RadixNode, namespace: bytes, token_ids: Sequence[int], block_id: int
    ) -> RadixNode | None:
        """Cache one full block (``token_ids``, held in ``block_id``) below ``parent``, a node
        its sequence holds locked, and move that lock onto the new child: ``insert`` of one
        block then ``move_lock``, without their general checks. This is every decode step that
        fills a block, so it is kept short. Returns the child (its ``block_id`` differs when the
        tree already held these tokens), or None on a hash collision (nothing cached)."""
        if parent.parent is None and parent is not self.root:
            raise ValueError("this node was evicted from the cache")
        if not self.block_pool.is_allocated(block_id):
            raise ValueError(f"block {block_id!r} is not an allocated block of the pool")
        block_tokens = tuple(token_ids)
        key = self._hash_fn(parent.key, namespace, block_tokens)
        child = parent.children.get(key)
        if child is None:
            child = RadixNode(key, namespace, block_tokens, block_id, parent)
            parent.children[key] = child
            self._attached(key)
        elif child.token_ids != block_tokens or child.namespace != namespace:
            return None  # a hash collision: refuse rather than alias (as _child_for)
        child.last_access_time = self._tick()
        # NOTE: no heap push: the child is locked from now on, and dec_lock_ref pushes it
        self._protect(child)
        child.lock_ref += 1
        return child

    def _child_for(
        self, node: RadixNode, ns: bytes, token_ids: Sequence[int], i: int, block_id: int
    ) -> RadixNode | None:
        bs = self.block_size
        block_tokens = tuple(token_ids[i * bs : (i + 1) * bs])
        key = self._hash_fn(node.key, ns, block_tokens)
        child = node.children.get(key)
        if child is not None:
            # NOTE: a key hit with other tokens is a hash collision; refuse rather than alias.
            same = child.token_ids == block_tokens and child.namespace == ns
            return child if same else None
        child = RadixNode(key, ns, block_tokens, block_id, node)
        node.children[key] = child
        self._attached(key)
        return child

    # -- references -------------------------------------------------------------------------

    def inc_lock_ref(self, node: RadixNode) -> None:
        """Protect ``node`` and its whole path to the root from eviction (no-op for the root)."""
        self._check_attached(node)
        while node is not self.root:
            self._protect(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: RadixNode) -> None:
        """Undo one ``inc_lock_ref(node)``, refreshing recency along the path; ValueError if
        ``node`` holds no lock."""
        if node is self.root:
            return
        if node.lock_ref <= 0:
            raise ValueError("dec_lock_ref on a node that holds no lock")
        now = self._tick()
        start = node
        while node is not self.root:
            node.lock_ref -= 1
            node.last_access_time = now
            self._unprotect(node)
            node = node.parent  # type: ignore[assignment]
        self._push_if_evictable(start)

    def move_lock(self, src: RadixNode, dst: RadixNode) -> None:
        """Turn a lock held on ``src`` into one on its descendant ``dst``, touching only the
        nodes in between (``inc_lock_ref(dst)`` then ``dec_lock_ref(src)``, in O(distance))."""
        segment: list[RadixNode] = []
        node = dst
        while node is not src:
            if node is self.root or node.parent is None:
                raise ValueError("move_lock: dst is not src or a descendant of src")
            segment.append(node)
            node = node.parent
        for node in segment:
            self._protect(node)
            node.lock_ref += 1

    def pin(self, token_ids: Sequence[int], cache_scope: CacheScope = CacheScope()) -> PrefixMatch:
        """Make the cached full-block prefix of ``token_ids`` unevictable until ``unpin`` of the
        returned ``last_node``; pins nest. Returns what was pinned (only what is cached)."""
        match = self.match_prefix(token_ids, cache_scope, count_stats=False)
        node = match.last_node
        while node is not self.root:
            self._protect(node)
            if node.pin_ref == 0:
                self._num_pinned += 1
            node.pin_ref += 1
            node = node.parent  # type: ignore[assignment]
        return match

    def unpin(self, node: RadixNode) -> None:
        """Undo one ``pin`` that returned ``node``; ValueError if ``node`` is not pinned."""
        if node is self.root:
            return
        if node.pin_ref <= 0:
            raise ValueError("unpin on a node that is not pinned")
        start = node
        while node is not self.root:
            node.pin_ref -= 1
            if node.pin_ref == 0:
                self._num_pinned -= 1
            self._unprotect(node)
            node = node.parent  # type: ignore[assignment]
        self._push_if_evictable(start)

    # -- eviction ---------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` unlocked, unpinned leaves to the pool, least recently used
        first (a chain therefore goes tail-first). Returns how many were freed."""
        if num_blocks < 0:
            raise ValueError(f"cannot evict a negative number of blocks ({num_blocks})")
        freed: list[int] = []
        while len(freed) < num_blocks and self._heap:
            last_access_time, _, node = heapq.heappop(self._heap)
            # NOTE: the heap is lazy; entries go stale when a node is touched, locked or grows.
            if not node.is_evictable or node.last_access_time != last_access_time:
                continue
            parent = node.parent
            del parent.children[node.key]  # type: ignore[union-attr]
            node.parent = None
            freed.append(node.block_id)
            node.block_id = -1
            self._num_nodes -= 1
            self._detached(node.key)
            self._push_if_evictable(parent)  # type: ignore[arg-type]
        self.block_pool.free(freed)
        self.evicted_blocks += len(freed)
        return len(freed)

    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every cached node, parents before children (a full walk: for tests and debugging)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- internals --------------------------------------------------------------------------

    def _walk(
        self,
        token_ids: Sequence[int],
        cache_scope: CacheScope,
        max_num_tokens: int | None,
        keys: list[bytes] | None,
    ) -> list[RadixNode]:
        if not self.enabled:
            return []
        bs = self.block_size
        limit = len(token_ids) if max_num_tokens is None else min(max_num_tokens, len(token_ids))
        path: list[RadixNode] = []
        node = self.root
        for i in range(max(limit, 0) // bs):
            block_tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            block_ns = cache_scope.block_namespace(i, bs)
            if keys is not None and i < len(keys):
                key = keys[i]
            else:
                key = self._hash_fn(node.key, block_ns, block_tokens)
                if keys is not None:
                    keys.append(key)
            child = node.children.get(key)
            if child is None or child.token_ids != block_tokens or child.namespace != block_ns:
                break
            path.append(child)
            node = child
        return path

    def _attached(self, key: bytes) -> None:
        self._num_nodes += 1
        self._keys[key] = self._keys.get(key, 0) + 1
        self._snapshot = None

    def _detached(self, key: bytes) -> None:
        left = self._keys.pop(key) - 1
        if left:
            self._keys[key] = left
        self._snapshot = None

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_attached(self, node: RadixNode) -> None:
        if node is not self.root and node.parent is None:
            raise ValueError("this node was evicted from the cache")

    def _protect(self, node: RadixNode) -> None:
        if node.lock_ref == 0 and node.pin_ref == 0:
            self._num_protected += 1

    def _unprotect(self, node: RadixNode) -> None:
        if node.lock_ref == 0 and node.pin_ref == 0:
            self._num_protected -= 1

    def _push_if_evictable(self, node: RadixNode) -> None:
        if node is self.root or not node.is_evictable:
            return
        self._heap_seq += 1
        heapq.heappush(self._heap, (node.last_access_time, self._heap_seq, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._compact_heap()

    def _compact_heap(self) -> None:
        live = {
            id(node): entry
            for entry in self._heap
            if (node := entry[2]).is_evictable and node.last_access_time == entry[0]
        }
        self._heap = list(live.values())
        heapq.heapify(self._heap)
