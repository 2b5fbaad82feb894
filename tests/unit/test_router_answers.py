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
