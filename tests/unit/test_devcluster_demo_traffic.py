"""The demo's and the e2e suites' traffic judge a streamed answer by its parsed frames."""

from __future__ import annotations

import json

from kvfleet.devcluster.demo import stream_problem


def _sse(*frames: object) -> str:
    return "".join(f"data: {f if isinstance(f, str) else json.dumps(f)}\n\n" for f in frames)


def _delta(text: str) -> dict[str, object]:
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": text}}]}


def test_a_token_that_reads_error_is_an_answer_like_any_other() -> None:
    # The check this replaced searched the body for '"error"' and failed a rollout e2e run on
    # a delta whose content was that word.
    assert stream_problem(_sse(_delta("Hi"), _delta("error"), _delta("9"), "[DONE]")) is None


def test_an_error_frame_is_named() -> None:
    error = {"error": {"message": "the replica failed mid-stream", "code": "upstream_failed"}}
    problem = stream_problem(_sse(_delta("Hi"), error, "[DONE]"))
    assert problem is not None and problem.startswith("an error frame") and \
        "upstream_failed" in problem


def test_a_stream_without_done_or_with_garbage_is_a_failure() -> None:
    assert stream_problem(_sse(_delta("Hi"))) == "no [DONE] at the end"
    assert stream_problem("") == "no [DONE] at the end"
    garbage = stream_problem(_sse("{not json", "[DONE]"))
    assert garbage is not None and garbage.startswith("a frame is not JSON")


def test_a_stream_ended_by_a_failed_engine_step_is_a_failure() -> None:
    # The engine ends such a stream with finish_reason "error" inside its 200, then [DONE]:
    # the stream-error rollout e2e saw its canary rolled back for errors no client counted.
    ended = {"object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {}, "finish_reason": "error"}]}
    problem = stream_problem(_sse(_delta("Hi"), ended, "[DONE]"))
    assert problem is not None and problem.startswith("finish_reason error")
    done = {**ended, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    assert stream_problem(_sse(_delta("Hi"), done, "[DONE]")) is None
