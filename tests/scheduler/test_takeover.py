"""Whether a probed executor may be taken back (``takeover.not_adoptable``):
each reason, in the order it is checked."""

from __future__ import annotations

from pagedkv.common.ids import MAX_EPOCH
from pagedkv.scheduler.takeover import not_adoptable, owned_by
from pagedkv.v1 import common_pb2, executor_pb2


def _info(
    model_id: str = "m", owner_id: str = "", epoch: int = 0, draining: bool = False
) -> executor_pb2.GetInfoResponse:
    owner = common_pb2.Owner(owner_id=owner_id, epoch=epoch)
    return executor_pb2.GetInfoResponse(model_id=model_id, owner=owner, draining=draining)


def test_an_executor_of_ours_or_of_no_one_serving_the_model_is_adoptable() -> None:
    assert not_adoptable(_info(owner_id="us", epoch=4), "m", "us") is None
    assert not_adoptable(_info(), "m", "us") is None


def test_each_reason_an_executor_cannot_be_taken_back() -> None:
    assert not_adoptable(_info(model_id="other"), "m", "us") == "it serves 'other', not 'm'"
    theirs = _info(owner_id="them", epoch=3)
    assert not_adoptable(theirs, "m", "us") == owned_by(theirs) == "owned by 'them' at epoch 3"
    spent = not_adoptable(_info(owner_id="us", epoch=MAX_EPOCH), "m", "us")
    assert spent == f"its epoch {MAX_EPOCH} is the maximum; restart it"
    assert not_adoptable(_info(draining=True), "m", "us") == "it is stopping"
