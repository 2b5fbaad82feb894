"""The signs a live answer is checked for (kvfleet.router.answers): each shows on what users
would call broken and stays off ordinary answers, prose and code alike."""

from __future__ import annotations

from kvfleet.router.answers import FLAGS, LOOP_MIN_CHARS, flags

PROSE = ("Kubernetes operators watch the objects they own and move the cluster towards what "
         "those objects declare: a Deployment's replicas, a pool's revision, a tenant's "
         "quota. When a node fails, the controller notices that fewer pods run than asked "
         "for and starts new ones elsewhere, without a person being paged at night.")
CODE = ("def reverse(text: str) -> str:\n    \"\"\"The characters of text, last first.\"\"\"\n"
        "    out = []\n    for char in text:\n        out.insert(0, char)\n"
        "    return ''.join(out)\n\nprint(reverse('kvfleet'))  # teelfvk\n")


def test_ordinary_answers_show_no_sign() -> None:
    for text in (PROSE, CODE, "Paris.", "Bonjour ! Ça va ? 你好，世界。"):
        assert flags(text, ["stop"]) == [], text


def test_each_sign() -> None:
    assert flags("", ["stop"]) == ["empty"]
    assert flags(" \n\t", ["stop"]) == ["empty"]
    assert flags(PROSE, ["length"]) == ["unfinished"]
    loop = "I am here. " * 40
    assert len(loop) >= LOOP_MIN_CHARS and flags(loop, ["length"]) == ["unfinished", "looping"]
    assert "looping" not in flags("I am here. " * 10, ["stop"])  # too short to tell
    garbled = "The cat sat" + "\ufffd" * 3 + " on the mat" + "\x00\x01"
    assert flags(garbled, ["stop"]) == ["garbled"]
    assert "garbled" not in flags(PROSE + "\ufffd", ["stop"])  # one stray byte in 300
    assert set(FLAGS) == {"empty", "unfinished", "looping", "garbled"}


def test_what_a_client_shapes_itself_says_nothing_of_the_revision() -> None:
    """`stop`, tools, `n`, a response format: the client can make the answer empty or cut at
    will, so it is not checked; a small max_tokens makes `unfinished` the client's choice; an
    answer the client left mid-way shows only `looping` or `garbled`."""
    from kvfleet.router.answers import MIN_TOKENS_FOR_UNFINISHED, checkable

    assert checkable({"messages": [], "max_tokens": 10, "temperature": 0.7})
    for field in ("stop", "tools", "n", "response_format", "logit_bias"):
        assert not checkable({"messages": [], field: None})
    assert flags(PROSE, ["length"], max_tokens=1) == []
    assert flags(PROSE, ["length"], max_tokens=MIN_TOKENS_FOR_UNFINISHED) == ["unfinished"]
    assert flags("", [], partial=True) == []
    assert flags("I am here. " * 40, [], partial=True) == ["looping"]
