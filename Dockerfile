FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md replay_schema.py ./
COPY replay_service ./replay_service
COPY capture ./capture
COPY web ./web
RUN pip install --no-cache-dir -e ".[service]"
EXPOSE 8470
VOLUME ["/data"]
CMD ["replay-service", "serve", "--data", "/data", "--host", "0.0.0.0", "--port", "8470"]
