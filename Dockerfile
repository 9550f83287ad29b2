# Phalanx peer image: one image for the bootstrap peer, trainers, the monitor and `phalanx health`.
#
#   docker build -t phalanx:latest .                                  (python:3.11-slim, CPU torch)
#   docker build --build-arg BASE_IMAGE=my-python311-image -t phalanx:latest .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t phalanx:cuda .
#
# Any wheel in scripts/docker-wheels/ is installed first (scripts/compose-e2e.sh puts torch's CPU
# wheel there so the build never downloads a CUDA build). The image runs as the non-root user
# `phalanx`; /data holds identities and checkpoints (mount volumes there). The healthcheck asks
# /readyz on PHALANX_HTTP_PORT (8080): a peer started with another --http-port should set that variable.
ARG BASE_IMAGE=python:3.11-slim

# ---- deps: a virtual environment with torch and every dependency (rebuilt only when pyproject.toml changes)
FROM ${BASE_IMAGE} AS deps
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/phalanx
COPY scripts/docker-wheels/ /wheels/
RUN if ls /wheels/*.whl >/dev/null 2>&1; then /opt/phalanx/bin/pip install /wheels/*.whl; \
    else /opt/phalanx/bin/pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; fi
COPY pyproject.toml setup.py /src/
RUN cd /src && mkdir -p phalanx peer protocol aggregation security sim tasks tools && touch README.md \
    && for d in phalanx peer protocol aggregation security sim tasks tools; do touch $d/__init__.py; done \
    && /opt/phalanx/bin/pip install /src && /opt/phalanx/bin/pip uninstall -y phalanx \
    && rm -rf /src/build /src/*.egg-info  # stale stubs in build/ would shadow the real files below

# ---- build: the phalanx wheel itself ------------------------------------------------------------
FROM deps AS build
COPY README.md setup.py /src/
COPY phalanx /src/phalanx
COPY peer /src/peer
COPY protocol /src/protocol
COPY aggregation /src/aggregation
COPY security /src/security
COPY sim /src/sim
COPY tasks /src/tasks
COPY tools /src/tools
RUN /opt/phalanx/bin/pip wheel --no-deps /src -w /dist

# ---- runtime: the environment, phalanx, an entry point and a non-root user ---------------------
FROM ${BASE_IMAGE}
RUN useradd --create-home --uid 10001 --user-group phalanx \
    && mkdir -p /data && chown phalanx:phalanx /data
COPY --from=deps /opt/phalanx /opt/phalanx
COPY --from=build /dist /dist
RUN /opt/phalanx/bin/pip install --no-deps --no-index /dist/*.whl && rm -rf /dist && /opt/phalanx/bin/phalanx --help >/dev/null
COPY scripts/docker-entrypoint.py /usr/local/bin/phalanx-entrypoint
ENV PATH=/opt/phalanx/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    PHALANX_HTTP_HOST=0.0.0.0 \
    PHALANX_HTTP_PORT=8080
USER phalanx
WORKDIR /home/phalanx
# 31337: libp2p (DHT and rounds) when started with --port 31337; 8080: /healthz /readyz /metrics /api/v1/status
EXPOSE 31337 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('PHALANX_HTTP_PORT', '8080')}/readyz\", timeout=4)"]
ENTRYPOINT ["python3", "/usr/local/bin/phalanx-entrypoint"]
CMD ["--help"]
