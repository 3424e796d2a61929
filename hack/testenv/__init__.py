"""The local test control plane (see hack/testenv.sh): build.py, certs.py, cluster.py."""
