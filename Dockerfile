# The Arbiter image used by docker-compose.yml (the worker; also `arbiter serve`, the front door).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY contract ./contract
COPY cores ./cores
COPY shells ./shells
COPY tools ./tools
COPY runtime ./runtime
COPY agents ./agents
COPY door ./door
COPY arbiter ./arbiter
COPY broker ./broker
RUN pip install --no-cache-dir .
USER nobody
ENTRYPOINT []
CMD ["arbiter", "worker"]
