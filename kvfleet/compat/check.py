"""`check(artifact, pool=None) -> list[Incompatibility]`: the one compatibility checker.

The webhook, the operator and `kvfleet check` all call this. An empty list means compatible.
Every Incompatibility names the object and field it is about, why, and the matrix version, so
a rejected `kubectl apply` says exactly what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet import __version__
from kvfleet.api import ModelArtifactSpec, ServingPoolSpec, base_hash
from kvfleet.compat.matrix import GPUArchitecture, Matrix, default_matrix, parse_version

# The operator deploys the engine bundled with this kvfleet release.
ENGINE_VERSION: str = __version__


@dataclass(frozen=True)
class Incompatibility:
    """One reason an artifact (and pool) cannot be served."""

    kind: str  # "ModelArtifact" or "ServingPool": the object `field` is a path in
    field: str
    reason: str
    matrix_version: str

    def __str__(self) -> str:
        return (
            f"{self.kind} {self.field}: {self.reason} (compatibility matrix {self.matrix_version})"
        )


@dataclass(frozen=True)
class DriverInfo:
    """What a node offers (from GPU feature discovery labels), when known."""

    driver_version: str
    cuda_version: str


def resolved_kv_cache_dtype(artifact: ModelArtifactSpec, pool: ServingPoolSpec | None) -> str:
    """The KV cache dtype a pool will use: `auto` means the model's compute dtype."""
    if pool is None or pool.engine.kv_cache_dtype.value == "auto":
        return artifact.dtype.value
    return pool.engine.kv_cache_dtype.value


class _Checker:
    def __init__(self, matrix: Matrix) -> None:
        self.matrix = matrix
        self.found: list[Incompatibility] = []

    def add(self, kind: str, field: str, reason: str) -> None:
        self.found.append(Incompatibility(kind, field, reason, self.matrix.version))

    def artifact(self, spec: ModelArtifactSpec, engine_version: str) -> None:
        a = "ModelArtifact"
        low, high = spec.engine_versions.min, spec.engine_versions.max
        version = parse_version(engine_version)
        if version < parse_version(low) or (high is not None and version >= parse_version(high)):
            self.add(
                a,
                "spec.engineVersions",
                f"requires engine >={low}"
                + (f",<{high}" if high else "")
                + f" but the fleet runs {engine_version}",
            )
        row = self.matrix.engine(engine_version)
        if row is None:
            self.add(a, "spec.engineVersions", f"engine {engine_version} has no matrix row")
            return
        engine = f"engine {row.label}"
        if spec.architecture.name not in row.architectures:
            self.add(
                a,
                "spec.architecture.name",
                f"architecture {spec.architecture.name!r} is "
                f"not supported by {engine} (supported: {sorted(row.architectures)})",
            )
        if spec.weights.format.value not in row.weight_formats:
            self.add(
                a,
                "spec.weights.format",
                f"format {spec.weights.format.value} is not supported by {engine}",
            )
        if spec.dtype.value not in row.dtypes:
            self.add(
                a,
                "spec.dtype",
                f"dtype {spec.dtype.value} is not supported by {engine} "
                f"(supported: {sorted(row.dtypes)})",
            )
        if (
            spec.quantization is not None
            and spec.quantization.method.value not in row.quantizations
        ):
            self.add(
                a,
                "spec.quantization.method",
                f"quantization "
                f"{spec.quantization.method.value} is not supported by {engine} "
                f"(supported: {sorted(row.quantizations)})",
            )
        self._family(spec)
        self._adapters(spec)
        for index, arch_name in enumerate(spec.gpu_architectures):
            arch = self.matrix.gpu_architectures.get(arch_name)
            if arch is None:
                self.add(
                    a, f"spec.gpuArchitectures[{index}]", f"unknown GPU architecture {arch_name}"
                )
                continue
            for field, reason in self._arch_problems(spec, None, arch):
                self.add(a, f"spec.gpuArchitectures[{index}]", f"{reason} ({field})")
        caps = spec.capabilities
        if (
            caps
            and caps.max_context_length
            and caps.max_context_length > spec.architecture.max_context_length
        ):
            self.add(
                a,
                "spec.capabilities.maxContextLength",
                f"{caps.max_context_length} exceeds "
                f"the architecture's maxContextLength {spec.architecture.max_context_length}",
            )

    def _family(self, spec: ModelArtifactSpec) -> None:
        family = self.matrix.model_families.get(spec.family)
        if family is None:
            return
        if spec.tokenizer.sha256 not in family.tokenizer_sha256:
            self.add(
                "ModelArtifact",
                "spec.tokenizer.sha256",
                f"tokenizer {spec.tokenizer.sha256[:12]}… "
                f"is not a known {spec.family} tokenizer; a mismatched tokenizer produces "
                "garbage, not an error",
            )
        template = spec.chat_template
        if (
            template is not None
            and family.chat_template_sha256
            and (template.sha256 not in family.chat_template_sha256)
        ):
            self.add(
                "ModelArtifact",
                "spec.chatTemplate.sha256",
                f"chat template {template.sha256[:12]}… is not a known {spec.family} template",
            )

    def _adapters(self, spec: ModelArtifactSpec) -> None:
        if not spec.adapters:
            return
        own_base = base_hash(spec)
        for index, adapter in enumerate(spec.adapters):
            field = f"spec.adapters[{index}].baseHash"
            if adapter.base_hash != own_base:
                self.add(
                    "ModelArtifact",
                    field,
                    f"adapter {adapter.name} was trained on base "
                    f"{adapter.base_hash[:12]}… but this artifact's base hash is "
                    f"{own_base[:12]}…",
                )
            required = self.matrix.adapter_bases.get(adapter.sha256)
            if required is not None and required != adapter.base_hash:
                self.add(
                    "ModelArtifact",
                    field,
                    f"the matrix records adapter {adapter.name} "
                    f"({adapter.sha256[:12]}…) as requiring base {required[:12]}…",
                )

    def _arch_problems(
        self, spec: ModelArtifactSpec, pool: ServingPoolSpec | None, arch: GPUArchitecture
    ) -> list[tuple[str, str]]:
        """(artifact/pool field, reason) for each dtype/kernel this architecture cannot run."""
        needs = [("dtype", spec.dtype.value, "spec.dtype")]
        if spec.quantization is not None:
            needs.append(
                ("quantization", spec.quantization.method.value, "spec.quantization.method")
            )
        if pool is not None:
            needs.append(
                ("kvCacheDtype", resolved_kv_cache_dtype(spec, pool), "spec.engine.kvCacheDtype")
            )
        problems = []
        have = parse_version(arch.compute_capability)
        for kind, name, field in needs:
            requirement = self.matrix.requirements.get((kind, name))
            if requirement is None:
                problems.append((field, f"{kind} {name} has no GPU requirement row"))
            elif have < parse_version(requirement.min_compute_capability):
                why = f": {requirement.why}" if requirement.why else ""
                problems.append(
                    (
                        field,
                        f"{kind} {name} needs compute capability "
                        f"{requirement.min_compute_capability}+, {arch.name} is "
                        f"{arch.compute_capability}{why}",
                    )
                )
        return problems

    def pool(self, spec: ModelArtifactSpec, pool: ServingPoolSpec, engine_version: str) -> None:
        p = "ServingPool"
        product = self.matrix.gpu_products.get(pool.gpu.product)
        if product is None:
            known = ", ".join(sorted(self.matrix.gpu_products))
            self.add(
                p, "spec.gpu.product", f"unknown GPU product {pool.gpu.product!r} (known: {known})"
            )
            return
        arch = self.matrix.gpu_architectures[product.architecture]
        row = self.matrix.engine(engine_version)
        if row is not None:
            if arch.name not in row.gpu_architectures:
                self.add(
                    p,
                    "spec.gpu.product",
                    f"{product.label} ({arch.name}) is not supported by engine {row.label}",
                )
            kv_dtype = resolved_kv_cache_dtype(spec, pool)
            if kv_dtype not in row.kv_cache_dtypes:
                self.add(
                    p,
                    "spec.engine.kvCacheDtype",
                    f"KV cache dtype {kv_dtype} is not "
                    f"supported by engine {row.label} (supported: {sorted(row.kv_cache_dtypes)})",
                )
            if pool.gpu.count > row.max_tensor_parallel:
                self.add(
                    p,
                    "spec.gpu.count",
                    f"{pool.gpu.count} GPUs per replica exceeds engine "
                    f"{row.label}'s tensor parallelism limit of {row.max_tensor_parallel}",
                )
        for field, reason in self._arch_problems(spec, pool, arch):
            where = "the artifact's " + field if field != "spec.engine.kvCacheDtype" else field
            self.add(p, "spec.gpu.product", f"{product.label}: {reason} ({where})")
        if spec.gpu_architectures and arch.name not in spec.gpu_architectures:
            self.add(
                p,
                "spec.gpu.product",
                f"{product.label} is {arch.name}; the artifact is "
                f"qualified only on {spec.gpu_architectures}",
            )
        heads = spec.architecture.num_kv_heads
        if pool.gpu.count > 1 and spec.architecture.num_query_heads % pool.gpu.count != 0:
            self.add(
                p,
                "spec.gpu.count",
                f"{spec.architecture.num_query_heads} query heads do "
                f"not split evenly over {pool.gpu.count} GPUs (KV heads: {heads})",
            )
        max_len = pool.engine.max_model_length
        if max_len is not None and max_len > spec.architecture.max_context_length:
            self.add(
                p,
                "spec.engine.maxModelLength",
                f"{max_len} exceeds the artifact's "
                f"maxContextLength {spec.architecture.max_context_length}",
            )

    def driver(
        self,
        spec: ModelArtifactSpec,
        pool: ServingPoolSpec,
        driver: DriverInfo,
        engine_version: str,
    ) -> None:
        need_cuda, need_driver = minimum_cuda_and_driver(self.matrix, spec, pool, engine_version)
        if parse_version(driver.cuda_version) < parse_version(need_cuda):
            self.add(
                "ServingPool",
                "spec.gpu.product",
                f"node CUDA {driver.cuda_version} is older than the required {need_cuda}",
            )
        if parse_version(driver.driver_version) < parse_version(need_driver):
            self.add(
                "ServingPool",
                "spec.gpu.product",
                f"node driver {driver.driver_version} is older than the required {need_driver}",
            )


def minimum_cuda_and_driver(
    matrix: Matrix, spec: ModelArtifactSpec, pool: ServingPoolSpec, engine_version: str
) -> tuple[str, str]:
    """The newest of the CUDA/driver minimums of engine, GPU architecture, dtypes and kernels."""
    cudas, drivers = ["0"], ["0"]
    row = matrix.engine(engine_version)
    if row is not None:
        cudas.append(row.min_cuda)
        drivers.append(row.min_driver)
    product = matrix.gpu_products.get(pool.gpu.product)
    if product is not None:
        arch = matrix.gpu_architectures[product.architecture]
        cudas.append(arch.min_cuda)
        drivers.append(arch.min_driver)
    keys = [("dtype", spec.dtype.value), ("kvCacheDtype", resolved_kv_cache_dtype(spec, pool))]
    if spec.quantization is not None:
        keys.append(("quantization", spec.quantization.method.value))
    for key in keys:
        requirement = matrix.requirements.get(key)
        if requirement is not None:
            cudas += [requirement.min_cuda] if requirement.min_cuda else []
            drivers += [requirement.min_driver] if requirement.min_driver else []
    return max(cudas, key=parse_version), max(drivers, key=parse_version)


def check(
    artifact: ModelArtifactSpec,
    pool: ServingPoolSpec | None = None,
    *,
    matrix: Matrix | None = None,
    engine_version: str = ENGINE_VERSION,
    driver: DriverInfo | None = None,
) -> list[Incompatibility]:
    """Everything that keeps `artifact` (served by `pool`, if given) from running."""
    checker = _Checker(matrix or default_matrix())
    checker.artifact(artifact, engine_version)
    if pool is not None:
        checker.pool(artifact, pool, engine_version)
        if driver is not None:
            checker.driver(artifact, pool, driver, engine_version)
    return checker.found
