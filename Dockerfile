# The replay service's image: the project's wheel (built from this checkout in the first stage, so the image holds
# what the wheel carries, the web view included) installed with its `service` extra into a virtual environment,
# run as the unprivileged user `replay` (uid 10001), its data on the volume /data, its tokens from a secret.
#   docker build -t routing-replay .                      (podman build works alike)
#   docker build --build-arg BASE=<an image with python3.11 and its venv module> ...
# A build behind a TLS-intercepting proxy passes the proxy's CA bundle as the secret `pip-ca`:
#   podman build --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt ...
ARG BASE=python:3.11-slim

FROM ${BASE} AS wheel
COPY . /src
# The wheel, and beside it what it depends on with its `service` extra (pyproject.toml's lists, one per line).
RUN --mount=type=secret,id=pip-ca \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    python3 -m venv /opt/build \
    && /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src \
    && python3 -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
print(*p['dependencies'], *p['optional-dependencies']['service'], sep='\n')" > /requirements.txt

FROM ${BASE}
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /data --shell /usr/sbin/nologin replay \
    && mkdir -p /data && chown replay:replay /data
# The dependencies in a layer of their own, rebuilt only when the list changes (not with every change of the code);
# then the wheel alone, and pip's check that the environment holds what it requires.
COPY --from=wheel /requirements.txt /opt/replay-requirements.txt
RUN --mount=type=secret,id=pip-ca \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    python3 -m venv /opt/replay \
    && /opt/replay/bin/pip install --no-cache-dir --quiet -r /opt/replay-requirements.txt
COPY --from=wheel /wheels /wheels
RUN /opt/replay/bin/pip install --no-cache-dir --no-deps /wheels/routing_replay-*.whl \
    && /opt/replay/bin/pip check \
    && rm -rf /wheels
ENV PATH=/opt/replay/bin:$PATH PYTHONDONTWRITEBYTECODE=1
USER replay
WORKDIR /data
EXPOSE 8470
VOLUME ["/data"]
# Listening on every address needs authentication: tokens (`token role [run-prefix]` per line) come from a
# mounted secret, readable by uid 10001; without that file the service refuses to start (it never serves 0.0.0.0
# unauthenticated).
ENV REPLAY_TOKENS_FILE=/run/secrets/replay-tokens
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
    CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8470/healthz')"
CMD ["replay-service", "serve", "--data", "/data", "--host", "0.0.0.0", "--port", "8470"]
