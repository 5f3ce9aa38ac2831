FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY replay_format ./replay_format
COPY replay_service ./replay_service
COPY replay_client ./replay_client
COPY capture ./capture
# The web view: the editable install below serves it from here (/app/web), next to the packages.
COPY web ./web
RUN pip install --no-cache-dir -e ".[service]"
EXPOSE 8470
VOLUME ["/data"]
# Listening on every address needs authentication: tokens (`token role [run-prefix]` per line) come from a
# mounted secret; without that file the service refuses to start (it never serves 0.0.0.0 unauthenticated).
ENV REPLAY_TOKENS_FILE=/run/secrets/replay-tokens
CMD ["replay-service", "serve", "--data", "/data", "--host", "0.0.0.0", "--port", "8470"]
