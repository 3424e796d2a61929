# The Transom operator: kopf + kubernetes client, no torch. Slim and non-root.
#   docker build -f images/operator.Dockerfile -t transom-operator .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY launcher/ launcher/
COPY operator/ operator/
RUN pip install --no-cache-dir --prefix=/install ".[operator]"

FROM python:3.11-slim
COPY --from=build /install /usr/local
USER 65532:65532
ENTRYPOINT ["transom-operator"]
