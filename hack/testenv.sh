#!/usr/bin/env bash
# Local Kubernetes control plane for tests and demos, on 127.0.0.1 only.
#   hack/testenv.sh build          build kube-apiserver, controller-manager, scheduler, kubectl,
#                                  kwok and helm from their Go modules into ~/.cache/transom/testenv,
#                                  and the operator image from images/operator.Dockerfile (buildah)
#   hack/testenv.sh images [NAME]  build and check images/*.Dockerfile (`make images`)
#   eval "$(hack/testenv.sh up)"   start etcd, the control plane, kwok nodes and S3; export KUBECONFIG
#   hack/testenv.sh env            print the exports of the running environment
#   hack/testenv.sh down           stop everything `up` started
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="$here/../.venv/bin/python"
if [ ! -x "$py" ]; then
  echo "hack/testenv.sh: the project venv is missing: run \`make install\` first" >&2
  exit 2
fi
exec "$py" "$here/testenv" "$@"
