# The trainer image: the `transom` launcher and coordinator plus torch; users build their
# training image FROM this one (or install `transom[train]` into their own). Non-root.
#   docker build -f images/trainer.Dockerfile -t transom-trainer .
# BASE: CPython 3.11 with pip in /usr/local, as python:3.11-slim has them (`make images`
# passes one made from Debian packages, offline). The versions are images/constraints.txt's.
ARG BASE=python:3.11-slim
# torch and the CUDA libraries it brings, in a layer of their own (about 5 GB) that changes
# only with the pins: an image rebuilt after a code change adds a layer of a few MB, and a
# node that has the previous image pulls only that.
FROM ${BASE} AS torch
WORKDIR /src
COPY images/constraints.txt images/
RUN pip install --no-cache-dir -c images/constraints.txt torch

# The rest, beside torch (pip leaves what is installed already): /install holds only it.
FROM torch AS build
COPY pyproject.toml README.md ./
COPY launcher/ launcher/
COPY operator/ operator/
RUN pip install --no-cache-dir --prefix=/install -c images/constraints.txt ".[train,s3]"

FROM torch
COPY --from=build /install /usr/local
WORKDIR /opt/transom
COPY examples/ /opt/transom/examples/
# The working directory is the user's: relative outputs (`--log-dir demo-logs`, a run's
# summary) are written there by uid 65532.
RUN chown 65532:65532 /opt/transom
USER 65532:65532
ENTRYPOINT ["transom"]
