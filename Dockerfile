# The image compose.yaml builds for the api and the worker.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pagedq pagedq
COPY api api
COPY worker worker
COPY scheduler scheduler
COPY blockmgr blockmgr
COPY kernels kernels
RUN pip install --no-cache-dir .
