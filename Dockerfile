# The Arbiter worker image used by docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY arbiter ./arbiter
COPY streams ./streams
COPY agents ./agents
COPY schemas ./schemas
COPY tools ./tools
COPY broker ./broker
RUN pip install --no-cache-dir .
USER nobody
ENTRYPOINT []
CMD ["arbiter", "worker"]
