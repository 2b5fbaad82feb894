"""`kvfleet.engine.__all__` is the engine's public surface: complete and importable."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import kvfleet.engine

# Modules of the engine core whose public names must each be exported or listed as internal.
CORE_MODULES = ("config", "request", "block_pool", "kv_cache_manager", "scheduler",
                "scheduler_output", "sampler", "engine", "llm", "errors")

# Public-looking names that are deliberately not part of the surface.
INTERNAL = {
    "Block", "BlockHash", "hash_block_tokens", "salt_hash", "MIB",
    "DEFAULT_KV_CACHE_MEMORY_BYTES", "CPU_PREFILL_TOKENS_PER_STEP", "ModelRunnerProtocol",
    "TokenizerProtocol", "ChatTemplateProtocol", "ChatMessages", "PromptInput", "NO_HIT",
}


def test_every_exported_name_resolves() -> None:
    for name in kvfleet.engine.__all__:
        assert getattr(kvfleet.engine, name) is not None, name
    assert sorted(kvfleet.engine.__all__) == sorted(kvfleet.engine._EXPORTS)


def test_every_public_name_of_the_core_is_exported_or_declared_internal() -> None:
    exported = set(kvfleet.engine.__all__)
    missing = []
    for module_name in CORE_MODULES:
        module = importlib.import_module(f"kvfleet.engine.{module_name}")
        for name, value in vars(module).items():
            if name.startswith("_") or inspect.ismodule(value) or isinstance(value, bool):
                continue
            if getattr(value, "__module__", module.__name__) != module.__name__:
                continue  # imported from elsewhere
            if not (inspect.isclass(value) or inspect.isfunction(value) or name.isupper()):
                continue
            if name not in exported and name not in INTERNAL:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"export these from kvfleet.engine or list them as internal: {missing}"


def test_exported_names_are_the_defining_objects() -> None:
    from kvfleet.engine.request import SamplingParams
    assert kvfleet.engine.SamplingParams is SamplingParams


def test_light_modules_do_not_import_torch() -> None:
    code = ("import sys, kvfleet.engine, kvfleet.engine.config, kvfleet.engine.request; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60)
    assert result.stdout.strip() == "False"


def test_unknown_names_raise_attribute_error() -> None:
    try:
        kvfleet.engine.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")
