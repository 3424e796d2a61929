# The Transom operator: kopf + kubernetes client, no torch. Slim and non-root.
#   docker build -f images/operator.Dockerfile -t transom-operator .
# BASE: CPython 3.11 with pip in /usr/local, as python:3.11-slim has them (`make images`
# passes one made from Debian packages, offline). The versions are images/constraints.txt's.
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY images/constraints.txt images/
COPY launcher/ launcher/
COPY operator/ operator/
RUN pip install --no-cache-dir --prefix=/install -c images/constraints.txt ".[operator]"

FROM ${BASE}
COPY --from=build /install /usr/local
USER 65532:65532
ENTRYPOINT ["transom-operator"]
