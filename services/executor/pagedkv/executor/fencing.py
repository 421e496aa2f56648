"""Fencing: which owner the executor obeys.

The executor has at most one owner ``(owner_id, epoch)``, set by
``Executor.reset``. Mutating calls must carry exactly the current owner
(``check_current``); ``reset`` takes a higher epoch (a new owner), or the
same owner and epoch (a restart of its session) (``check_takeover``). An
owner no lease can have (no id, epoch 0 or past ``MAX_EPOCH``) is refused
before either check (``check_owner_fields``). These checks change nothing:
what a reset does (rows freed, open step streams ended) is the engine's.
"""

from __future__ import annotations

from pagedkv.common.errors import FailedPrecondition, InvalidArgument
from pagedkv.common.ids import MAX_EPOCH
from pagedkv.v1 import common_pb2


def check_owner_fields(owner: common_pb2.Owner) -> None:
    """InvalidArgument for an owner no lease can have (see Owner in common.proto):
    checked before fencing, so that an epoch past ``MAX_EPOCH`` never becomes
    the owner's (no scheduler could take over with ``epoch + 1`` in a uint64)."""
    if not owner.owner_id:
        raise InvalidArgument("owner.owner_id: required")
    if owner.epoch == 0:
        raise InvalidArgument("owner.epoch: 0 is no epoch (epochs start at 1)")
    if owner.epoch > MAX_EPOCH:
        raise InvalidArgument(f"owner.epoch: {owner.epoch} > the largest epoch {MAX_EPOCH}")


def check_current(owner: common_pb2.Owner, current: common_pb2.Owner) -> None:
    """FailedPrecondition unless ``owner`` is ``current`` (its fields checked
    first, ``check_owner_fields``)."""
    check_owner_fields(owner)
    if (owner.owner_id, owner.epoch) != (current.owner_id, current.epoch):
        raise FailedPrecondition(
            f"owner: {owner.owner_id!r} epoch {owner.epoch} is not the current owner "
            f"({current.owner_id!r} epoch {current.epoch})"
        )


def check_takeover(owner: common_pb2.Owner, current: common_pb2.Owner) -> None:
    """FailedPrecondition unless ``owner`` may reset the executor: the
    ``current`` owner again, or a higher epoch. ``owner``'s fields are
    checked before (``check_owner_fields``)."""
    same = (owner.owner_id, owner.epoch) == (current.owner_id, current.epoch)
    if not same and owner.epoch <= current.epoch:
        raise FailedPrecondition(
            f"owner.epoch: {owner.epoch} is not above the current epoch "
            f"{current.epoch} ({current.owner_id!r})"
        )
