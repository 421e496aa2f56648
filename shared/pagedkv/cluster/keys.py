"""Every Redis key of a pagedkv cluster, and the one place that names them.

Every key starts with a prefix ``P`` (``pagedkv`` by default; clusters with
different prefixes can share one Redis). ``{addr}`` is an executor's
advertised ``HOST:PORT``, ``{member}`` a scheduler's member id, ``{inc}`` an
executor incarnation id (a new one each time an executor process starts).

======================  ======  ==========  ==========  ==================================
key                     type    writer      TTL         contents
======================  ======  ==========  ==========  ==================================
P:executors             set     executor    none        addresses of registered executors
                                                        (readers drop members whose record
                                                        expired)
P:executor:{addr}       string  executor    3 s PX,     JSON ``ExecutorRecord``: address,
                                            beats at    incarnation_id, model_id,
                                            TTL/3       block_size, num_blocks,
                                                        bytes_per_block, max_num_rows,
                                                        max_model_len, registered_at_ms
P:schedulers            set     scheduler   none        ids of scheduler members (readers
                                                        drop expired ones)
P:scheduler:{member}    string  scheduler   PX, beats   JSON ``MemberRecord``: member_id,
                                                        address, registered_at_ms
P:lease:{addr}          hash    lease       PX,         owner_id, epoch (decimal uint64),
                                holder      renewed     incarnation_id
P:epoch:{addr}          string  lease       never       highest fencing epoch handed out
                                scripts                 for the address (decimal, never
                                                        decreases)
P:mirror:{inc}          hash    mirror of   10 min PX,  prefix-cache mirror: ``<hash hex>``
                                the lease   refreshed   (group 0) or ``<hash hex>:<g>``
                                holder      by writes   (group g > 0) -> block id (decimal)
P:events:{inc}          stream  mirror of   10 min PX   KV events, ``XADD MAXLEN ~ cap``
                                the lease               (10,000 by default): seq, type
                                holder                  (stored / removed / cleared),
                                                        group, hash_size, block_ids (packed
                                                        little-endian uint32), hashes
                                                        (concatenated, hash_size bytes each)
P:events_seq:{inc}      string  mirror      10 min PX   the last ``seq`` of the stream
P:load:{member}         string  scheduler   3 s PX,     JSON ``LoadReport``: member_id,
                                            written     updated_ms, per executor held:
                                            when it     address, incarnation_id,
                                            changes     num_running, num_waiting,
                                            (100 ms)    num_free_blocks,
                                                        num_usable_blocks, draining
P:boot                  hash    first       never       boot_id (random), created_ms (Redis
                                member                  TIME): a new boot_id means Redis
                                                        restarted without its data
======================  ======  ==========  ==========  ==================================

``seq`` increases by one per stream entry (a gap means entries were trimmed);
it starts again at 1 when Redis lost its data, and a ``cleared`` entry tells a
reader to drop what it knows of the incarnation before applying what follows.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "pagedkv"


HOST_TIER_SUFFIX = "/host"


def host_tier_incarnation(incarnation_id: str) -> str:
    """The name an executor incarnation's host tier is mirrored under: its
    own mirror hash and event stream, block ids being host block ids."""
    return incarnation_id + HOST_TIER_SUFFIX


def mirror_field(block_hash: bytes, group_id: int) -> str:
    """The mirror hash field of ``block_hash`` in KV cache group ``group_id``."""
    assert group_id >= 0
    return block_hash.hex() if group_id == 0 else f"{block_hash.hex()}:{group_id}"


def parse_mirror_field(field: str) -> tuple[bytes, int]:
    """``(block_hash, group_id)`` of a mirror hash field (``mirror_field``'s inverse)."""
    hex_hash, _, group = field.partition(":")
    return bytes.fromhex(hex_hash), int(group) if group else 0


@dataclass(frozen=True)
class Keys:
    """Builds the key names of one cluster (see the module docstring)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or self.prefix.endswith(":") or any(c.isspace() for c in self.prefix):
            raise ValueError(
                f"redis key prefix: {self.prefix!r} is empty, ends with ':' or has spaces"
            )

    def executors(self) -> str:
        return f"{self.prefix}:executors"

    def executor(self, address: str) -> str:
        return f"{self.prefix}:executor:{address}"

    def schedulers(self) -> str:
        return f"{self.prefix}:schedulers"

    def scheduler(self, member_id: str) -> str:
        return f"{self.prefix}:scheduler:{member_id}"

    def load(self, member_id: str) -> str:
        return f"{self.prefix}:load:{member_id}"

    def lease(self, address: str) -> str:
        return f"{self.prefix}:lease:{address}"

    def epoch(self, address: str) -> str:
        return f"{self.prefix}:epoch:{address}"

    def mirror(self, incarnation_id: str) -> str:
        return f"{self.prefix}:mirror:{incarnation_id}"

    def events(self, incarnation_id: str) -> str:
        return f"{self.prefix}:events:{incarnation_id}"

    def events_seq(self, incarnation_id: str) -> str:
        return f"{self.prefix}:events_seq:{incarnation_id}"

    def incarnation_keys(self, incarnation_id: str) -> tuple[str, str, str]:
        """The mirror's keys of one incarnation: mirror hash, event stream, seq."""
        return (
            self.mirror(incarnation_id),
            self.events(incarnation_id),
            self.events_seq(incarnation_id),
        )

    def boot(self) -> str:
        return f"{self.prefix}:boot"
