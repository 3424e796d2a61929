"""The Transom operator: runs `TrainingJob` resources on Kubernetes.

`api` holds the pydantic models of the `TrainingJob` custom resource; they are the single
source of the CRD, which `crdgen` writes to `crds/` and to the helm chart.
"""
