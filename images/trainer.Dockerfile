# The trainer image: the `transom` launcher and coordinator plus torch; users build their
# training image FROM this one (or install `transom[train]` into their own). Non-root.
#   docker build -f images/trainer.Dockerfile -t transom-trainer .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY launcher/ launcher/
COPY operator/ operator/
RUN pip install --no-cache-dir --prefix=/install ".[train,s3]"

FROM python:3.11-slim
COPY --from=build /install /usr/local
COPY examples/ /opt/transom/examples/
WORKDIR /opt/transom
USER 65532:65532
ENTRYPOINT ["transom"]
