"""How the coordinator reaches the Kubernetes API server: address, credentials, TLS.

The coordinator talks to Kubernetes for two things only, its job's `status.training`
(kube_status.py) and its replicas' identities (kube_identity.py), with plain aiohttp rather
than the kubernetes client, so its image stays small and `transom` imports without it. In a
pod it uses the pod's ServiceAccount token and CA (`in_cluster`); tests point it at an API
server from outside (`transom coordinator --kube-api URL --kube-token-file F --kube-ca-file C`).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from transom import contract
from transom.defaults import KUBE_REQUEST_TIMEOUT_S as REQUEST_TIMEOUT_S  # noqa: F401  (re-exported)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class KubeApi:
    url: str  # https://host:port of the API server
    token_file: Path  # read on every request: projected tokens rotate
    ca_file: Path

    @classmethod
    def in_cluster(cls) -> KubeApi:
        host = os.environ.get(contract.ENV_KUBERNETES_SERVICE_HOST)
        port = os.environ.get(contract.ENV_KUBERNETES_SERVICE_PORT)
        if not host or not port:
            raise ValueError("not running in a Kubernetes pod (KUBERNETES_SERVICE_HOST/PORT unset)")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", SA_DIR / "token", SA_DIR / "ca.crt")

    def headers(self, content_type: str = "application/json") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}", "Content-Type": content_type}

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def path(self, path: str) -> str:
        return self.url.rstrip("/") + path
