"""A revision's identity and what a new one changes (kvfleet.operator.revisions)."""

from __future__ import annotations

from operator_fakes import artifact, pool

from kvfleet.api import manifest_hash
from kvfleet.operator import builders, revisions


def _parts(**sets: object) -> revisions.RevisionParts:
    return revisions.parts_of(pool(**sets), manifest_hash(artifact().spec), "img:1")


def test_the_operators_default_image_is_a_part_unless_the_pool_names_one() -> None:
    a = manifest_hash(artifact().spec)
    assert revisions.parts_of(pool(), a, "img:1").revision != \
        revisions.parts_of(pool(), a, "img:2").revision  # an operator upgrade rolls the pool
    pinned = pool(spec__pod__image="mine@sha256:" + "2" * 64)
    assert revisions.parts_of(pinned, a, "img:1").revision == \
        revisions.parts_of(pinned, a, "img:2").revision


def test_a_change_is_described_part_by_part() -> None:
    old = _parts()
    assert revisions.describe_change(old, _parts(spec__engine__maxModelLength=4096), "a") == \
        "settings KVFLEET_MAX_MODEL_LEN 8192 -> 4096"
    assert revisions.describe_change(old, _parts(spec__engine__int8Activations=True), "a") == \
        "settings KVFLEET_INT8_ACTIVATIONS 0 -> 1"
    image = revisions.parts_of(pool(spec__pod__image="img:2"), old.artifact, "img:1")
    assert revisions.describe_change(old, image, "a") == "image img:1 -> img:2"
    assert revisions.describe_change(None, image, "a") == "artifactRef is now a"


def test_a_deployment_says_its_parts_and_an_older_operators_does_not() -> None:
    p, a = pool(spec__engine__maxModelLength=2048), artifact()
    deployment = builders.build_deployment(p, a, None)
    parts = revisions.parts_of_deployment(deployment)
    assert parts == revisions.parts_of(p, manifest_hash(a.spec), builders.EngineOptions().image)
    assert revisions.revision_for(p.to_wire(), a.to_wire()) == parts.revision
    del deployment["metadata"]["annotations"][revisions.SETTINGS_ANNOTATION]
    assert revisions.parts_of_deployment(deployment) is None
