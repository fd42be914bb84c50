# The Arbiter image used by docker-compose.yml (the worker; also `arbiter serve`, the front door).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
# The one namespace `arbiter` is these five folders' arbiter/ (pyproject.toml): copy each.
COPY schemas ./schemas
COPY streams ./streams
COPY agents ./agents
COPY edge ./edge
COPY arbiter ./arbiter
RUN pip install --no-cache-dir ".[all]"
USER nobody
ENTRYPOINT []
CMD ["arbiter", "worker"]
