from __future__ import annotations

from typing import Any

import pytest
from engine_fakes import make_request

from kvfleet.engine.errors import InvalidRequestError
from kvfleet.engine.request import (
    DeliveryState,
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
)


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"temperature": -0.1}, "sampling_params.temperature", "must be >= 0, got -0.1"),
        ({"top_p": 1.5}, "sampling_params.top_p", "must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "sampling_params.top_p", "must be in (0, 1], got 0.0"),
        ({"top_k": -1}, "sampling_params.top_k", "must be an integer >= 0"),
        ({"max_tokens": 0}, "sampling_params.max_tokens", "must be an integer >= 1"),
        ({"min_tokens": 5, "max_tokens": 4}, "sampling_params.min_tokens", "max_tokens=4"),
        ({"stop": ("",)}, "sampling_params.stop", "non-empty"),
        ({"stop_token_ids": (-1,)}, "sampling_params.stop_token_ids", ">= 0"),
    ],
)
def test_invalid_sampling_params_name_the_field(params: dict[str, Any], field: str,
                                                message: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**params)
    assert exc.value.field == field
    assert message in str(exc.value) and field in str(exc.value)


def test_a_single_stop_string_is_accepted() -> None:
    assert SamplingParams(stop="\n").stop == ("\n",)  # type: ignore[arg-type]


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        Request("r", [])
    assert exc.value.field == "prompt"


def test_compute_state_moves_forward_and_finishing_is_idempotent() -> None:
    request = make_request("r")
    assert request.status is RequestStatus.ACCEPTED
    assert request.transition(RequestStatus.QUEUED)
    assert not request.transition(RequestStatus.QUEUED)  # already there
    assert not request.transition(RequestStatus.ACCEPTED)  # never backwards
    assert request.transition(RequestStatus.PREFILLING)
    assert request.transition(RequestStatus.QUEUED)  # preempted
    assert request.transition(RequestStatus.DECODING)
    assert request.finish(FinishReason.CANCELLED, now=5.0)
    assert not request.finish(FinishReason.CANCELLED, now=6.0)
    assert not request.finish(FinishReason.STOP, now=7.0)
    assert (request.status, request.finish_reason, request.timings.finish_time) == (
        RequestStatus.CANCELLED, FinishReason.CANCELLED, 5.0)


@pytest.mark.parametrize(("reason", "status"), [
    (FinishReason.STOP, RequestStatus.COMPLETED), (FinishReason.LENGTH, RequestStatus.COMPLETED),
    (FinishReason.CANCELLED, RequestStatus.CANCELLED),
    (FinishReason.DEADLINE, RequestStatus.CANCELLED), (FinishReason.ERROR, RequestStatus.FAILED),
])
def test_finish_reason_decides_the_final_state(reason: FinishReason,
                                               status: RequestStatus) -> None:
    request = make_request("r")
    request.finish(reason, now=1.0)
    assert request.status is status and request.is_finished


def test_delivery_state_is_independent_of_compute_state() -> None:
    request = make_request("r")
    assert request.set_delivery(DeliveryState.STREAMING)
    assert request.set_delivery(DeliveryState.DISCONNECTED)
    assert not request.set_delivery(DeliveryState.ACKED)
    assert request.delivery is DeliveryState.DISCONNECTED
    assert request.status is RequestStatus.ACCEPTED


def test_timings() -> None:
    request = make_request("r", arrival_time=10.0)
    request.timings.first_scheduled_time = 10.5
    request.append_output_token(4, now=11.0)
    request.append_output_token(5, now=11.5)
    assert request.timings.queue_time == 0.5
    assert request.timings.time_to_first_token == 1.0
    assert request.timings.last_token_time == 11.5
    assert request.all_token_ids[-2:] == [4, 5] and request.num_output_tokens == 2
